"""Where each ComfyUI diffusion model keeps its transformer blocks."""
from __future__ import annotations

from torch import nn

# Diffusion model class (or a base class of it) -> attributes holding its blocks, in execution order.
BLOCK_LISTS: dict[str, tuple[str, ...]] = {
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "Flux": ("double_blocks", "single_blocks"),
    "Chroma": ("double_blocks", "single_blocks"),
    "HunyuanVideo": ("double_blocks", "single_blocks"),
    "WanModel": ("blocks",),
    "MMDiT": ("joint_blocks",),
    "NextDiT": ("layers",),  # Lumina 2 and Z-Image
}


def block_list_names(diffusion_model: nn.Module) -> tuple[str, ...]:
    """The block attributes of ``diffusion_model``; subclasses (e.g. VACE Wan) inherit their base's entry."""
    for cls in type(diffusion_model).__mro__:
        names = BLOCK_LISTS.get(cls.__name__, ())
        if names and all(hasattr(diffusion_model, name) for name in names):  # AuraFlow's MMDiT is another one
            return names
    known = ", ".join(sorted(BLOCK_LISTS))
    raise ValueError(f"Group Offload does not know where {type(diffusion_model).__name__} keeps its blocks "
                     f"(supported: {known})")


def find_blocks(diffusion_model: nn.Module) -> list[nn.Module]:
    """Every block of ``diffusion_model``, in execution order."""
    return [block for name in block_list_names(diffusion_model) for block in getattr(diffusion_model, name)]
