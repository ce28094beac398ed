"""Real-ComfyUI test bed: booting ComfyUI, fixture models, a live server and small workflow helpers.

Nothing of ComfyUI or torch is stubbed. The test-only changes to ComfyUI are to its detection:
:func:`widen_qwen_detection`, which lets ComfyUI load Qwen-Image models narrower than the real one,
and ``other_models.save_with_detection``, which makes it detect tiny files of other models.

Importable from tests and from ``bench/`` scripts (put this folder on ``sys.path``). Importing it
does not import ComfyUI; :func:`boot_comfyui_in_process` and the fixture generators do.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO_ROOT / "tests"
TESTNODES_DIR = TESTS_DIR / "comfy_testnodes"
FIXTURE_CACHE = REPO_ROOT / ".cache" / "fixtures"
ARTIFACTS_DIR = REPO_ROOT / ".artifacts"
EMBEDDED_COMFYUI = REPO_ROOT / ".comfyui"

PACK_DIR_NAME = "comfyui-group-offload"
TESTNODES_DIR_NAME = "comfyui-group-offload-testnodes"

TINY_QWEN_NAME = "tiny_qwen_image.safetensors"
FULL_WIDTH_QWEN_NAME = "full_width_qwen_image.safetensors"
TINY_VAE_NAME = "tiny_wan_vae.safetensors"

# Bump when the generators change what they write, so cached fixture files are regenerated.
_FIXTURE_FORMAT = 1

# Qwen-Image as ComfyUI builds it by default (comfy/ldm/qwen_image/model.py) and as the real model is.
FULL_WIDTH_QWEN = {
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "out_channels": 16,
    "axes_dims_rope": (16, 56, 56),
}
_FULL_WIDTH_QWEN_WEIGHTS = {k: v for k, v in FULL_WIDTH_QWEN.items() if k != "axes_dims_rope"}
_QWEN_PATCH_SIZE = 2  # process_img() hard-codes 2x2 patches; in_channels = 16 latent channels * 2 * 2
_QWEN_IN_CHANNELS = 64


# --------------------------------------------------------------------------------------------
# Booting ComfyUI
# --------------------------------------------------------------------------------------------

def comfyui_path() -> Path:
    """The ComfyUI checkout in use: ``$COMFYUI_PATH``, else the embedded ``.comfyui`` of this repo."""
    configured = os.environ.get("COMFYUI_PATH")
    return Path(configured).resolve() if configured else EMBEDDED_COMFYUI.resolve()


def comfyui_version() -> str:
    """The version the ComfyUI checkout in use declares (``comfyui_version.py``), or "unknown"."""
    version_file = comfyui_path() / "comfyui_version.py"
    match = version_file.is_file() and re.search(r'__version__\s*=\s*"([^"]+)"', version_file.read_text())
    return match.group(1) if match else "unknown"


def default_cpu() -> bool:
    """Run ComfyUI with ``--cpu`` unless torch sees a CUDA device."""
    return not torch.cuda.is_available()


def prepare_comfy_import(cpu: bool | None = None) -> None:
    """Make ``import comfy`` and ``import nodes`` resolve to ComfyUI and set its CLI flags.

    ComfyUI only parses ``sys.argv`` when ``comfy.options.enable_args_parsing()`` was called (main.py
    does); in-process it parses ``[]``, so the flags are set on ``comfy.cli_args.args`` directly,
    before ``comfy.model_management`` reads them at import.
    """
    root = comfyui_path()
    if not (root / "comfy" / "model_management.py").is_file():
        raise FileNotFoundError(f"No ComfyUI checkout at {root} (set COMFYUI_PATH or run `python3 dev.py setup`)")
    # First on sys.path (before '' or the repository): this pack has a `nodes/` package that must
    # not shadow ComfyUI's nodes.py. Once nodes.py is imported the order no longer matters.
    if "nodes" not in sys.modules and sys.path[:1] != [str(root)]:
        if str(root) in sys.path:
            sys.path.remove(str(root))
        sys.path.insert(0, str(root))
    import comfy.cli_args

    want_cpu = default_cpu() if cpu is None else cpu
    if "comfy.model_management" in sys.modules:
        if comfy.cli_args.args.cpu != want_cpu:
            logger.warning("comfy.model_management was imported with cpu=%s; cannot switch to %s",
                           comfy.cli_args.args.cpu, want_cpu)
        return
    comfy.cli_args.args.cpu = want_cpu


def _check_comfy_nodes_module(nodes_module: ModuleType) -> None:
    location = Path(getattr(nodes_module, "__file__", "") or "").resolve()
    if location.parent != comfyui_path():
        raise RuntimeError(f"`import nodes` found {location}, not ComfyUI's nodes.py in {comfyui_path()}: "
                           "something put this repository before ComfyUI on sys.path")


def _run_maybe_async(result: Any) -> Any:
    return asyncio.run(result) if inspect.isawaitable(result) else result


def _load_custom_node(nodes_module: ModuleType, module_dir: Path) -> bool:
    """Load a node pack exactly as ComfyUI's startup does (``nodes.load_custom_node``)."""
    return bool(_run_maybe_async(nodes_module.load_custom_node(str(module_dir), module_parent="custom_nodes")))


def pack_dir() -> Path:
    """The pack as ComfyUI sees it: the custom_nodes link dev.py made, else the repository itself."""
    link = comfyui_path() / "custom_nodes" / PACK_DIR_NAME
    if link.exists() and link.resolve() == REPO_ROOT:
        return link
    return REPO_ROOT


_booted_nodes: ModuleType | None = None


def boot_comfyui_in_process(cpu: bool | None = None) -> ModuleType:
    """Import ComfyUI into this process with its built-in extra nodes, the test nodes and this pack.

    Idempotent. ``cpu=None`` means ``--cpu`` unless CUDA is available. API nodes and other custom
    nodes are not loaded. This pack is loaded only when its root ``__init__.py`` exists; a pack that
    fails to import is logged (as ComfyUI does), not raised. Returns ComfyUI's ``nodes`` module.
    """
    global _booted_nodes
    if _booted_nodes is not None:
        return _booted_nodes
    prepare_comfy_import(cpu)
    import comfy.model_management  # noqa: F401  (reads the CLI flags set above)
    # As in main.py: ComfyUI's `utils` package must be imported before nodes.py puts comfy/ first on
    # sys.path, or `utils` resolves to comfy/utils.py and comfy_extras/nodes_images.py fails to import.
    import utils.extra_config  # noqa: F401
    import nodes

    _check_comfy_nodes_module(nodes)
    init = nodes.init_extra_nodes
    parameters = inspect.signature(init).parameters
    flags = {name: False for name in ("init_custom_nodes", "init_api_nodes") if name in parameters}
    _run_maybe_async(init(**flags))

    if not _load_custom_node(nodes, TESTNODES_DIR):
        raise RuntimeError(f"ComfyUI could not load the test nodes in {TESTNODES_DIR}; see the log above")
    if (REPO_ROOT / "__init__.py").is_file() and not _load_custom_node(nodes, pack_dir()):
        logger.error("ComfyUI could not load this pack from %s; its nodes are missing", pack_dir())
    _booted_nodes = nodes
    return nodes


# --------------------------------------------------------------------------------------------
# Test-only widening of Qwen-Image detection
# --------------------------------------------------------------------------------------------

def qwen_rope_axes(attention_head_dim: int) -> tuple[int, int, int]:
    """RoPE axes for a Qwen-Image of this head width, in the real model's proportions (16, 56, 56)/128.

    ComfyUI needs three even axes summing to the head width, so the width must be a multiple of 32.
    """
    if attention_head_dim % 32:
        raise ValueError(f"attention_head_dim must be a multiple of 32, got {attention_head_dim}")
    small = attention_head_dim // 8
    large = (attention_head_dim - small) // 2
    return small, large, large


def _qwen_widths(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    """The Qwen-Image constructor arguments that the weights determine (RoPE axes excepted)."""
    inner_dim = state_dict[f"{prefix}img_in.weight"].shape[0]
    head_dim = state_dict[f"{prefix}transformer_blocks.0.attn.norm_q.weight"].shape[0]
    return {
        "attention_head_dim": head_dim,
        "num_attention_heads": inner_dim // head_dim,
        "joint_attention_dim": state_dict[f"{prefix}txt_in.weight"].shape[1],
        "out_channels": state_dict[f"{prefix}proj_out.weight"].shape[0] // _QWEN_PATCH_SIZE ** 2,
    }


def widen_qwen_detection() -> None:
    """TEST ONLY: let ComfyUI load Qwen-Image models narrower than the real one.

    ComfyUI recognises Qwen-Image by ``txt_norm.weight`` and reads only ``in_channels`` and
    ``num_layers`` from the weights; every width is the constructor default. This wraps
    ``comfy.model_detection.detect_unet_config`` so that, for a Qwen-Image whose widths differ from
    the real ones, the widths are read from the weights. Full-width models get exactly the config
    ComfyUI would have produced. Idempotent; nothing shipped may call it.
    """
    prepare_comfy_import()
    import comfy.model_detection as model_detection

    original = model_detection.detect_unet_config
    if getattr(original, "group_offload_original", None) is not None:
        return

    @functools.wraps(original)
    def detect_unet_config(state_dict, key_prefix, *args, **kwargs):
        config = original(state_dict, key_prefix, *args, **kwargs)
        if config is None or config.get("image_model") != "qwen_image":
            return config
        widths = _qwen_widths(state_dict, key_prefix)
        if widths == _FULL_WIDTH_QWEN_WEIGHTS:
            return config
        return {**config, **widths, "axes_dims_rope": qwen_rope_axes(widths["attention_head_dim"])}

    detect_unet_config.group_offload_original = original
    model_detection.detect_unet_config = detect_unet_config


# --------------------------------------------------------------------------------------------
# Fixture models
# --------------------------------------------------------------------------------------------

def _fill(shapes: dict[str, torch.Size], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded values for every tensor; ComfyUI's ops skip init, so nothing may be left unset.

    Weights are N(0, 1/fan_in) so activations stay O(1) at any width; norm scales are 1 + N(0, 0.02²);
    biases N(0, 0.02²). Keys are filled in sorted order from one generator.
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key in sorted(shapes):
        shape = shapes[key]
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if key.endswith("bias"):
            value = noise.mul_(0.02)
        elif key.endswith("gamma") or len(shape) == 1:
            value = noise.mul_(0.02).add_(1.0)
        else:
            fan_in = shape[1:].numel()
            value = noise.mul_(fan_in ** -0.5)
        tensors[key] = value.to(dtype).contiguous()
    return tensors


def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial))
    os.replace(partial, path)
    return path


def _qwen_shapes(num_layers: int, **dims: Any) -> dict[str, torch.Size]:
    """Key names and shapes of ComfyUI's own QwenImageTransformer2DModel, built on the meta device."""
    prepare_comfy_import()
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(num_layers=num_layers, in_channels=_QWEN_IN_CHANNELS,
                                        patch_size=_QWEN_PATCH_SIZE, device="meta",
                                        operations=comfy.ops.disable_weight_init, **dims)
    return {key: value.shape for key, value in model.state_dict().items()}


def make_tiny_qwen_image(path: Path, num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         *, num_attention_heads: int = 2, attention_head_dim: int = 32,
                         joint_attention_dim: int = 64) -> Path:
    """Write a narrow Qwen-Image diffusion model (ComfyUI key names, no prefix) to ``path``.

    Loading it needs :func:`widen_qwen_detection`. The defaults make a 0.7 MB file (bf16, 2 layers).
    """
    dims = {"num_attention_heads": num_attention_heads, "attention_head_dim": attention_head_dim,
            "joint_attention_dim": joint_attention_dim, "axes_dims_rope": qwen_rope_axes(attention_head_dim)}
    return _save(_fill(_qwen_shapes(num_layers, **dims), seed, dtype), path)


def make_full_width_qwen_image(path: Path, num_layers: int = 1, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a Qwen-Image with the real widths and ``num_layers`` blocks (761 MB for one block in bf16).

    It loads in unpatched ComfyUI. Tensors are generated one at a time in float32 and kept in ``dtype``.
    """
    return _save(_fill(_qwen_shapes(num_layers), seed, dtype), path)


def make_tiny_wan_vae(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, dim: int = 8) -> Path:
    """Write a narrow Wan 2.1 VAE (16 latent channels, as Qwen-Image uses) that VAELoader detects.

    ComfyUI recognises it by ``decoder.middle.0.residual.0.gamma`` and reads ``dim`` from
    ``decoder.head.0.gamma``; the rest of its config is fixed, so only ``dim`` may vary.
    """
    prepare_comfy_import()
    from comfy.ldm.wan.vae import WanVAE

    with torch.device("meta"):
        vae = WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                     temperal_downsample=[False, True, True])
    shapes = {key: value.shape for key, value in vae.state_dict().items()}
    return _save(_fill(shapes, seed, dtype), path)


def _cached(stem: str, generator: Callable[..., Path], **params: Any) -> Path:
    """Generate a fixture once per parameter set into ``.cache/fixtures`` and reuse it afterwards."""
    key_source = json.dumps({"generator": generator.__name__, "format": _FIXTURE_FORMAT,
                             **{k: str(v) for k, v in params.items()}}, sort_keys=True)
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    path = FIXTURE_CACHE / f"{stem}-{key}.safetensors"
    if not path.exists():
        started = time.monotonic()
        generator(path, **params)
        logger.info("generated %s in %.1f s", path, time.monotonic() - started)
    return path


def tiny_qwen_image_file(num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         **dims: int) -> Path:
    """Cached :func:`make_tiny_qwen_image`."""
    return _cached("tiny_qwen_image", make_tiny_qwen_image, num_layers=num_layers, seed=seed, dtype=dtype, **dims)


def full_width_qwen_image_file(num_layers: int = 1, seed: int = 0) -> Path:
    """Cached :func:`make_full_width_qwen_image`."""
    return _cached("full_width_qwen_image", make_full_width_qwen_image, num_layers=num_layers, seed=seed)


def tiny_wan_vae_file(seed: int = 0) -> Path:
    """Cached :func:`make_tiny_wan_vae`."""
    return _cached("tiny_wan_vae", make_tiny_wan_vae, seed=seed)


@dataclass(frozen=True)
class ModelDir:
    """A ComfyUI base directory with fixture models; the names are what the loader nodes take."""

    base_dir: Path
    unet_name: str = TINY_QWEN_NAME
    vae_name: str = TINY_VAE_NAME
    full_width_unet_name: str | None = None

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    try:
        target.symlink_to(source)
    except OSError:
        shutil.copyfile(source, target)


def _link_or_copy_dir(source: Path, target: Path) -> None:
    if target.is_symlink() or target.exists():
        return
    try:
        target.symlink_to(source, target_is_directory=True)
    except OSError:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".*", "__pycache__"))


def populate_models(base_dir: Path, *, full_width: bool = False) -> ModelDir:
    """Lay out fixture models in ``base_dir/models`` as ComfyUI expects (files linked from the cache).

    ``models/loras`` is created empty. ``full_width`` adds the 761 MB single-block Qwen-Image.
    """
    base_dir = Path(base_dir)
    models = base_dir / "models"
    _link_or_copy(tiny_qwen_image_file(), models / "diffusion_models" / TINY_QWEN_NAME)
    _link_or_copy(tiny_wan_vae_file(), models / "vae" / TINY_VAE_NAME)
    (models / "loras").mkdir(parents=True, exist_ok=True)
    full_width_name = None
    if full_width:
        full_width_name = FULL_WIDTH_QWEN_NAME
        _link_or_copy(full_width_qwen_image_file(), models / "diffusion_models" / full_width_name)
    return ModelDir(base_dir=base_dir, full_width_unet_name=full_width_name)


def use_models_in_process(model_dir: ModelDir) -> None:
    """Make the in-process ComfyUI's loader nodes find the models of ``model_dir``."""
    boot_comfyui_in_process()
    import folder_paths

    for kind in ("diffusion_models", "vae", "loras"):
        folder = model_dir.models_dir / kind
        if str(folder) not in folder_paths.get_folder_paths(kind):
            folder_paths.add_model_folder_path(kind, str(folder), is_default=True)


# --------------------------------------------------------------------------------------------
# Driving nodes in-process
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeResult:
    """What a node returned: its outputs in order and its UI dict (``None`` when it has none)."""

    outputs: tuple
    ui: dict | None = None


def run_node(class_type: str, **inputs: Any) -> NodeResult:
    """Call a registered node the way ComfyUI's executor does, for V1 and V3 nodes alike.

    V3 nodes (``comfy_api`` ``io.ComfyNode``) run on a locked class clone with empty hidden inputs,
    as in ``execution._async_map_node_over_list``; V1 nodes on a fresh instance. Call it inside
    ``torch.inference_mode()`` to match a real prompt.
    """
    nodes = boot_comfyui_in_process()
    from comfy_api.internal import _ComfyNodeInternal, make_locked_method_func

    node_class = nodes.NODE_CLASS_MAPPINGS[class_type]
    if issubclass(node_class, _ComfyNodeInternal):
        node_class.VALIDATE_CLASS()
        function = make_locked_method_func(node_class, node_class.FUNCTION, node_class.PREPARE_CLASS_CLONE({}))
    else:
        function = getattr(node_class(), node_class.FUNCTION)
    returned = _run_maybe_async(function(**inputs))

    if isinstance(returned, dict):
        return NodeResult(tuple(returned.get("result", ())), returned.get("ui"))
    if isinstance(returned, tuple):
        return NodeResult(returned)
    ui = returned.ui.as_dict() if hasattr(returned.ui, "as_dict") else returned.ui
    return NodeResult(tuple(returned.args), ui)


def make_test_conditioning(seed: int = 0, tokens: int = 8, joint_dim: int = 64) -> list:
    """A Qwen-shaped CONDITIONING: ``[[cond [1, tokens, joint_dim], {"pooled_output": None}]]``.

    That is what ComfyUI's Qwen-Image text encoder yields when no token is masked (its attention
    mask is then dropped and it has no pooled output).
    """
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn((1, tokens, joint_dim), generator=generator)
    return [[cond, {"pooled_output": None}]]


def qwen_joint_dim(model: Any) -> int:
    """The text width a Qwen-Image MODEL (a ComfyUI ModelPatcher) expects."""
    return model.model.diffusion_model.txt_norm.weight.shape[0]


@dataclass(frozen=True)
class Txt2ImgResult:
    """KSampler's latent (``samples["samples"]``) and VAEDecode's IMAGE ``[B, H, W, C]`` (or ``None``)."""

    latent: torch.Tensor
    image: torch.Tensor | None


def run_txt2img(model: Any, vae: Any = None, seed: int = 0, steps: int = 2, *, cfg: float = 4.0,
                width: int = 64, height: int = 64, sampler_name: str = "euler", scheduler: str = "simple",
                positive: list | None = None, negative: list | None = None) -> Txt2ImgResult:
    """EmptySD3LatentImage -> KSampler -> VAEDecode (when ``vae`` is given), in-process, like a prompt.

    ``model`` is any MODEL (e.g. an offloaded clone). Without conditionings, seeded test ones of the
    model's text width are used (positive seed 1, negative seed 2, same token count so ComfyUI
    batches cond and uncond).
    """
    joint_dim = qwen_joint_dim(model)
    positive = positive if positive is not None else make_test_conditioning(1, joint_dim=joint_dim)
    negative = negative if negative is not None else make_test_conditioning(2, joint_dim=joint_dim)
    with torch.inference_mode():
        (latent,) = run_node("EmptySD3LatentImage", width=width, height=height, batch_size=1).outputs
        (samples,) = run_node("KSampler", model=model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                              scheduler=scheduler, positive=positive, negative=negative,
                              latent_image=latent, denoise=1.0).outputs
        image = run_node("VAEDecode", vae=vae, samples=samples).outputs[0] if vae is not None else None
    return Txt2ImgResult(latent=samples["samples"], image=image)


# --------------------------------------------------------------------------------------------
# API-format workflows
# --------------------------------------------------------------------------------------------

def txt2img_workflow(unet_name: str, vae_name: str = TINY_VAE_NAME, *, seed: int = 0, steps: int = 2,
                     cfg: float = 4.0, width: int = 64, height: int = 64, joint_dim: int = 64,
                     filename_prefix: str = "group_offload_test",
                     model_patch: tuple[str, dict[str, Any]] | None = None) -> dict[str, dict]:
    """An API-format prompt: UNETLoader -> [model_patch] -> KSampler -> VAEDecode -> SaveImage.

    ``model_patch = (class_type, inputs)`` inserts node "10" between loader and sampler; its
    ``model`` input is wired to the loader and its first output to the sampler.
    """
    workflow: dict[str, dict] = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "3": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "joint_dim": joint_dim}},
        "4": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 2, "tokens": 8, "joint_dim": joint_dim}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
            "denoise": 1.0}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["2", 0]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": filename_prefix}},
    }
    if model_patch is not None:
        class_type, inputs = model_patch
        workflow["10"] = {"class_type": class_type, "inputs": {**inputs, "model": ["1", 0]}}
        workflow["6"]["inputs"]["model"] = ["10", 0]
    return workflow


# --------------------------------------------------------------------------------------------
# A real ComfyUI server
# --------------------------------------------------------------------------------------------

class PromptRejected(Exception):
    """POST /prompt answered 400; ``body`` is ComfyUI's error JSON (``error``, ``node_errors``)."""

    def __init__(self, body: dict):
        super().__init__(json.dumps(body)[:2000])
        self.body = body


class PromptFailed(Exception):
    """A queued prompt finished with an execution error; ``entry`` is its /history entry."""

    def __init__(self, entry: dict):
        messages = [m for m in entry.get("status", {}).get("messages", []) if m[0] == "execution_error"]
        super().__init__(json.dumps(messages)[:4000])
        self.entry = entry


@functools.cache
def _server_flags(main_py: Path) -> frozenset[str]:
    """The long options this ComfyUI's main.py accepts (from ``main.py --help``)."""
    help_text = subprocess.run([sys.executable, str(main_py), "--help"], capture_output=True, text=True,
                               cwd=main_py.parent, timeout=120, check=True).stdout
    return frozenset(word.strip("[],") for word in help_text.split() if word.startswith("--"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ComfyServer:
    """ComfyUI's real ``main.py`` serving a base directory with this pack, the test nodes and fixtures.

    Use as a context manager; the server is always stopped by its pid on exit. Its output goes to
    ``base_dir/comfyui.log``; :meth:`log_tail` is in every error raised here.
    """

    base_dir: Path
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    # ComfyUI's classic cache drops a node's output as soon as a prompt no longer has the node; newest
    # ComfyUI's default cache keeps it until RAM runs short. Tests of what outlives a model want the first.
    classic_cache: bool = False
    cpu: bool | None = None
    full_width: bool = False
    startup_timeout: float = 120.0
    models: ModelDir = field(init=False)
    object_info: dict = field(init=False, default_factory=dict)
    port: int = field(init=False, default=0)
    process: subprocess.Popen | None = field(init=False, default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "comfyui.log"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    def __enter__(self) -> ComfyServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            logger.error("ComfyUI server log (%s):\n%s", self.log_path, self.log_tail())
        self.stop()

    def _start(self) -> None:
        self.base_dir = Path(self.base_dir).resolve()
        custom_nodes = self.base_dir / "custom_nodes"
        custom_nodes.mkdir(parents=True, exist_ok=True)
        for name, target in ((PACK_DIR_NAME, REPO_ROOT), (TESTNODES_DIR_NAME, TESTNODES_DIR)):
            _link_or_copy_dir(target, custom_nodes / name)
        self.models = populate_models(self.base_dir, full_width=self.full_width)

        main_py = comfyui_path() / "main.py"
        flags = _server_flags(main_py)
        self.port = _free_port()
        command = [sys.executable, str(main_py), "--listen", "127.0.0.1", "--port", str(self.port),
                   "--base-directory", str(self.base_dir)]
        if default_cpu() if self.cpu is None else self.cpu:
            command.append("--cpu")
        if "--database-url" in flags:
            # Not sqlite:///:memory:, whose connection SQLAlchemy then uses across threads: ComfyUI
            # logs "SQLite objects created in a thread can only be used in that same thread".
            command += ["--database-url", f"sqlite:///{self.base_dir / 'comfyui.db'}"]
        if self.classic_cache and "--cache-classic" in flags:
            command.append("--cache-classic")
        command += list(self.extra_args)

        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=main_py.parent, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        logger.info("started ComfyUI pid %d: %s", self.process.pid, " ".join(command))
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                self.object_info = self.get("/object_info")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        raise TimeoutError(f"ComfyUI did not answer /object_info within {self.startup_timeout:.0f} s; "
                           f"log:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"ComfyUI server exited (code {code}); log:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminate the server by pid, killing it if it does not exit within 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        logger.info("stopped ComfyUI pid %d", self.process.pid)

    def log_tail(self, max_chars: int = 20000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except FileNotFoundError:
            return "(no log)"

    def _request(self, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        try:
            return status, json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return status, payload.decode(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> Any:
        """GET ``path`` and return the decoded JSON; raises on HTTP errors."""
        status, payload = self._request(path, timeout=timeout)
        if status >= 400:
            raise RuntimeError(f"GET {path} -> HTTP {status}: {payload}")
        return payload

    def post(self, path: str, body: Any, timeout: float = 30.0) -> tuple[int, Any]:
        """POST JSON to ``path``; returns ``(status, decoded body)`` without raising."""
        return self._request(path, body, timeout=timeout)

    def queue(self, workflow: dict) -> str:
        """Queue an API-format prompt; returns its prompt_id or raises :class:`PromptRejected`."""
        status, payload = self.post("/prompt", {"prompt": workflow})
        if status == 400:
            raise PromptRejected(payload)
        if status != 200:
            raise RuntimeError(f"POST /prompt -> HTTP {status}: {payload}; log:\n{self.log_tail()}")
        return payload["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120.0, check: bool = True) -> dict:
        """Poll /history until the prompt finished; returns its entry.

        With ``check``, a prompt that failed raises :class:`PromptFailed`.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if check and entry["status"].get("status_str") == "error":
                    raise PromptFailed(entry)
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s; log:\n{self.log_tail()}")

    def run(self, workflow: dict, timeout: float = 120.0) -> dict:
        """Queue ``workflow`` and wait for it; returns the /history entry."""
        return self.wait(self.queue(workflow), timeout=timeout)

    def output_images(self, entry: dict) -> list[Path]:
        """The image files a finished prompt saved into the output folder."""
        images = []
        for output in entry.get("outputs", {}).values():
            for image in output.get("images", []):
                if image.get("type") == "output":
                    images.append(self.output_dir / image.get("subfolder", "") / image["filename"])
        return images


def find_chromium() -> str | None:
    """A Chromium/Chrome executable for browser tests (on PATH or installed by Playwright), or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    playwright_dir = Path(os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or Path.home() / ".cache" / "ms-playwright")
    for candidate in sorted(playwright_dir.glob("chromium-*/chrome-linux*/chrome"), reverse=True):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None
