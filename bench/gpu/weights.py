"""Seeded random weights in the shapes of ComfyUI's own Qwen-Image, tiled from one pool so that 40 GB are
written at memory speed."""
from __future__ import annotations

import contextlib
import sys
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from .config import BenchConfig


class RandomWeights:
    """Seeded weights like the test fixtures (N(0, 1/fan_in), norm scales 1 + N(0, 0.02²), biases
    N(0, 0.02²)), tiled from one random pool so that 40 GB are written at memory speed."""

    def __init__(self, pool_numel: int, seed: int = 0) -> None:
        self._pool = torch.randn(pool_numel, generator=torch.Generator().manual_seed(seed))
        self._scaled: dict[tuple[float, float, torch.dtype], torch.Tensor] = {}

    def _pool_for(self, scale: float, shift: float, dtype: torch.dtype) -> torch.Tensor:
        key = (scale, shift, dtype)
        if key not in self._scaled:
            values = (self._pool * scale + shift).to(dtype)
            self._scaled[key] = torch.cat([values, values])  # any window of pool length is contiguous
        return self._scaled[key]

    def _scale(self, name: str, shape: torch.Size) -> tuple[float, float]:
        if name.endswith("bias"):
            return 0.02, 0.0
        if len(shape) == 1:
            return 0.02, 1.0
        return shape[1:].numel() ** -0.5, 0.0

    def _values(self, name: str, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
        """``name``'s pool, its window length and where ``name``'s values start in it."""
        pool = self._pool_for(*self._scale(name, shape), dtype)
        length = pool.numel() // 2
        return pool, length, zlib.crc32(name.encode()) % length

    def window(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A view of the pool for ``name`` (no memory of its own) when it fits in one window."""
        pool, length, offset = self._values(name, shape, dtype)
        if shape.numel() > length:
            return self.filled(name, shape, dtype)
        return pool[offset : offset + shape.numel()].view(shape)

    def filled(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of its own holding ``name``'s values."""
        out = torch.empty(shape, dtype=dtype)
        self(name, out)
        return out

    def __call__(self, name: str, out: torch.Tensor) -> None:
        pool, length, offset = self._values(name, out.shape, out.dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), length):
            chunk = flat[start : start + length]
            chunk.copy_(pool[offset : offset + chunk.numel()])


def fill_module(module: nn.Module, fill: RandomWeights) -> None:
    """Write ``fill``'s values into every parameter and buffer of ``module``."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        fill(name, tensor.data)


def comfy_qwen_on_meta(config: BenchConfig) -> nn.Module:
    """ComfyUI's Qwen-Image at this size on the meta device, every weight made (no memory)."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from testbed.fixture_models import qwen_rope_axes

    with eager_weights():
        return QwenImageTransformer2DModel(num_layers=config.blocks, attention_head_dim=config.head_dim,
                                           num_attention_heads=config.heads, joint_attention_dim=config.joint_dim,
                                           axes_dims_rope=qwen_rope_axes(config.head_dim), dtype=torch.bfloat16,
                                           device="meta", operations=comfy.ops.disable_weight_init)


def comfy_qwen_shapes(config: BenchConfig) -> dict[str, torch.Size]:
    """The state-dict shapes of ComfyUI's Qwen-Image at this size."""
    return {name: t.shape for name, t in comfy_qwen_on_meta(config).state_dict().items()}


@contextlib.contextmanager
def eager_weights() -> Iterator[None]:
    """ComfyUI's layers made with every weight: Dynamic VRAM's switch makes a Linear's weight wait for
    the state dict (no shape to read before it)."""
    memory_management = sys.modules.get("comfy.memory_management")
    switched = getattr(memory_management, "aimdo_enabled", False)
    if switched:
        memory_management.aimdo_enabled = False
    try:
        yield
    finally:
        if switched:
            memory_management.aimdo_enabled = True


def random_state_dict(config: BenchConfig, dtype: torch.dtype, owned: bool) -> dict[str, torch.Tensor]:
    """The checkpoint as ComfyUI's loader would read it. ``owned``: every tensor has its own memory
    (Dynamic VRAM takes the tensors as the model's weights); else views of one pool, which a
    copying load turns into distinct weights without holding the model twice."""
    weights = RandomWeights(config.pool_numel)
    make = weights.filled if owned else weights.window
    return {name: make(name, shape, dtype if len(shape) > 1 else torch.bfloat16)  # fp8 files keep 1-D tensors bf16
            for name, shape in comfy_qwen_shapes(config).items()}
