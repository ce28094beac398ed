"""Where a ComfyUI diffusion model keeps its transformer blocks.

The generic rule: the blocks are the outermost ``nn.ModuleList``s (or ``nn.ModuleDict``s, as in
Cosmos 1) of modules of one class that each hold at least a tenth of the model's weights and together
most of them, in the order in which the model registers them.  Lists inside a submodule count only
where that submodule holds most of the weights (a wrapper of the trunk, not an embedder or a refiner
with blocks of its own).  For the DiTs ComfyUI ships, registration order is the order of the lists'
first block calls in a forward (``tests/nodes/test_block_finder.py`` traces each).
``_EXCEPTIONS`` holds the classes for which the rule would be wrong, each with the reason. How a model
calls its blocks (their ``forward``, other methods, their parts one by one) needs no entry here: the
handle learns it at the first call (``offload_core.hooks.PartWrappers``).
"""
from __future__ import annotations

import logging
import weakref

from torch import nn

log = logging.getLogger(__name__)

_MIN_LIST_SHARE = 0.1  # a list below a tenth of the weights is an embedder or refiner, not the trunk

# Diffusion model class (or a base class of it) -> block lists, in execution order, where the
# generic rule would be wrong; an empty tuple means: no block list Group Offload can stream.
_EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # SD 1.x/2.x/XL, SVD: forward_timestep_embed runs the layers of each input/output block one
    # by one; the blocks' own forward never runs, so a wrapped forward would never load them.
    "UNetModel": (),
    # Lumina 2 / Z-Image, OmniGen 2 and Boogu: the refiners run context_refiner first, against their
    # registration (ref_image_refiner only with reference images). In real checkpoints they are
    # below the share anyway; in shallow ones the rule would take them in the wrong order.
    "NextDiT": ("layers",),
    "OmniGen2Transformer2DModel": ("layers",),
    "BooguTransformer2DModel": ("double_stream_layers", "single_stream_layers"),
    # Wan VACE: vace_blocks run interleaved with the main blocks, once per VACE input.
    "VaceWanModel": ("blocks",),
}

# A text encoder's owner of the blocks, by the model its patcher holds (``own_text_encoder_layers``); a diffusion
# model's is its ``diffusion_model``.
DIFFUSION_MODEL = "diffusion_model"
_OWNER_PATHS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()

# Found once per model, while its lists are in place: the patcher hides them during ComfyUI's load.
_FOUND: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()
_LOGGED: set[tuple[str, tuple[str, ...], str]] = set()


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _is_block_list(module: nn.Module) -> bool:
    """A non-empty list of modules of one class that can run (containers have no forward of their own)."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
        return False
    classes = {type(m) for m in module.children()}
    return len(classes) == 1 and not issubclass(classes.pop(), (nn.ModuleList, nn.ModuleDict))


def _in_the_trunk(diffusion_model: nn.Module, path: str, total: int) -> bool:
    """Whether every submodule around ``path`` holds most of the weights."""
    parts = path.split(".")
    return all(2 * _nbytes(diffusion_model.get_submodule(".".join(parts[:n]))) > total for n in range(1, len(parts)))


def _generic_block_lists(diffusion_model: nn.Module) -> tuple[str, ...]:
    """Paths of the outermost one-class lists holding a tenth or more of the weights, in registration order."""
    found = _trunk_lists(diffusion_model)
    if not found:
        raise ValueError(f"Group Offload does not know where {type(diffusion_model).__name__} keeps its blocks: "
                         f"no list of repeated modules holds most of its weights; connect the model to the "
                         f"sampler without Group Offload")
    return found


def _trunk_lists(diffusion_model: nn.Module) -> tuple[str, ...]:
    """The generic rule's block lists, or none where they would not hold most of the weights."""
    total = _nbytes(diffusion_model)
    found: list[str] = []
    for path, module in diffusion_model.named_modules():
        if any(path.startswith(f"{outer}.") for outer in found) or not _is_block_list(module):
            continue
        if _nbytes(module) >= _MIN_LIST_SHARE * total and _in_the_trunk(diffusion_model, path, total):
            found.append(path)
    held = sum(_nbytes(diffusion_model.get_submodule(path)) for path in found)
    return tuple(found) if total and 2 * held > total else ()


def _exception_for(diffusion_model: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    for cls in type(diffusion_model).__mro__:
        paths = _EXCEPTIONS.get(cls.__name__)
        if paths is not None and all(_has_submodule(diffusion_model, path) for path in paths):
            return cls.__name__, paths
    return None


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _find_paths(diffusion_model: nn.Module) -> tuple[tuple[str, ...], str]:
    name = type(diffusion_model).__name__
    exception = _exception_for(diffusion_model)
    if exception is None:
        return _generic_block_lists(diffusion_model), "the generic rule"
    table_name, paths = exception
    if not paths:
        raise ValueError(f"{name} has no list of transformer blocks that Group Offload can stream (its blocks "
                         f"never run as whole modules); connect the model to the sampler without Group Offload")
    return paths, f"the exceptions entry for {table_name}"


def block_list_paths(diffusion_model: nn.Module) -> tuple[str, ...]:
    """Dotted paths of the lists holding ``diffusion_model``'s blocks, in execution order.

    Found at the first call and the same for every later one, also while the lists are hidden.
    """
    paths = _FOUND.get(diffusion_model)
    if paths is None:
        paths, rule = _find_paths(diffusion_model)
        _FOUND[diffusion_model] = paths
        if (key := (type(diffusion_model).__name__, paths, rule)) not in _LOGGED:
            _LOGGED.add(key)
            log.info("Group Offload: the blocks of %s are %s (by %s)", key[0], ", ".join(paths), rule)
    return paths


def block_list_owners(diffusion_model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(owner, attribute)`` of each block list, e.g. ``(model.transformer, "layers")``."""
    owners = []
    for path in block_list_paths(diffusion_model):
        parent, _, attribute = path.rpartition(".")
        owners.append((diffusion_model.get_submodule(parent), attribute))
    return owners


def find_blocks(diffusion_model: nn.Module) -> list[nn.Module]:
    """Every block of ``diffusion_model``, in execution order."""
    paths = block_list_paths(diffusion_model)
    return [block for path in paths for block in diffusion_model.get_submodule(path).children()]



def refuse_weight_caches(diffusion_model: nn.Module) -> None:
    """``ValueError`` for a block layer that keeps copies of its weights from call to call, as it declares with an
    ``evict_quantized_caches`` method (ComfyUI-GGUF's Q4_CR layers keep a device copy of each packed weight, its
    LoRA-patched weight too): a copy made from a streamed group's bytes would outlive the group, read after the
    group's buffer held another group's bytes, or keep every layer's weight on the GPU."""
    for path in block_list_paths(diffusion_model):
        for name, module in diffusion_model.get_submodule(path).named_modules(prefix=path):
            if callable(getattr(module, "evict_quantized_caches", None)):
                raise ValueError(f"Group Offload cannot stream {name} ({type(module).__name__}): that layer keeps "
                                 "copies of its weights from call to call (ComfyUI-GGUF's Q4_CR files), which would "
                                 "outlive the streamed bytes they are made from. Run this model without Group "
                                 "Offload, or use a GGUF file of another type (Q8_0, Q4_K_M...)")


# --- whose blocks: a diffusion model's, or a text encoder's layers ------------------------------------------

def owner_path(base_model: nn.Module) -> str:
    """The attribute of ``base_model`` (a patcher's model) holding the module whose forward runs the blocks."""
    return _OWNER_PATHS.get(base_model, DIFFUSION_MODEL)


def blocks_owner(base_model: nn.Module) -> nn.Module:
    """The module of ``base_model`` whose forward runs the blocks: its diffusion model, or for a CLIP the text
    encoder that holds the layers (``own_text_encoder_layers``). Its blocks are ``find_blocks(owner)``."""
    return base_model.get_submodule(owner_path(base_model))


def is_text_encoder(base_model: nn.Module) -> bool:
    return base_model in _OWNER_PATHS


def own_text_encoder_layers(text_encoders: nn.Module) -> str:
    """The text encoder inside a CLIP's model (``CLIP.cond_stage_model``: one encoder, or several side by side as
    for SD3 and Flux) whose layers hold most of the weights, by the generic rule, as the owner of the blocks;
    its attribute, found once per model. ``ValueError`` naming the class where no encoder holds them."""
    if text_encoders in _OWNER_PATHS:
        return _OWNER_PATHS[text_encoders]
    name = type(text_encoders).__name__
    paths = _trunk_lists(text_encoders)
    if not paths:
        raise ValueError(f"Group Offload (text encoder) does not know where {name} keeps its transformer layers: no "
                         f"list of repeated modules holds most of its weights. Connect the CLIP to the text encode "
                         f"nodes without Group Offload (text encoder)")
    owner = paths[0].split(".")[0]
    if any(path.count(".") == 0 or path.split(".")[0] != owner for path in paths):  # (the trunk is one encoder)
        raise ValueError(f"Group Offload (text encoder) cannot stream {name}: its layers ({', '.join(paths)}) are not "
                         f"inside one text encoder whose forward runs them. Connect the CLIP to the text encode "
                         f"nodes without Group Offload (text encoder)")
    _OWNER_PATHS[text_encoders] = owner
    return owner


def carry_owner(source: nn.Module, target: nn.Module) -> None:
    """``target``, a model loaded again in place of the text encoders ``source`` (a deep copy, Dynamic VRAM's plain
    twin), has its owning encoder found as ``source`` had; a diffusion model's needs nothing."""
    if target is not source and is_text_encoder(source):
        own_text_encoder_layers(target)


def encoders_left_whole(text_encoders: nn.Module) -> list[tuple[str, int]]:
    """The other text encoders beside the one whose layers stream (CLIP-L and CLIP-G beside SD3's T5), with their
    bytes: ComfyUI loads them as it does without the node."""
    owner = owner_path(text_encoders)
    return [(name, _nbytes(child)) for name, child in text_encoders.named_children()
            if name != owner and _nbytes(child)]
