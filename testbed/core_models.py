"""Small pure-torch models for the core's tests, offloaded beside a plain twin: a stack of blocks, one mapped from a
file, one with quantized weights."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload_core import apply_group_offload, flatten, map_file


class Block(nn.Module):
    """A DiT-ish block: two streams in, two out, keyword arguments, a buffer and mixed dtypes."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.attn = nn.Linear(width, width, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width, dtype=dtype), nn.GELU(), nn.Linear(2 * width, width, dtype=dtype))
        self.ctx_proj = nn.Linear(width, width, bias=False, dtype=dtype)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, width, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attn(self.norm(x)) * scale
        h = h + self.mlp(h) * self.gate.to(h.dtype)
        return h, ctx + self.ctx_proj(h.mean(dim=1, keepdim=True))


class Net(nn.Module):
    def __init__(self, depth: int = 6, width: int = 32, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width, dtype=dtype)
        self.blocks = nn.ModuleList(Block(width, dtype) for _ in range(depth))
        self.head = nn.Linear(width, 8, dtype=dtype)
        self.order: list[int] | None = None  # run blocks in another order when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        ctx = torch.zeros_like(h[:, :1])
        for i in self.order or range(len(self.blocks)):
            h, ctx = self.blocks[i](h, ctx=ctx, scale=0.5)
        return self.head(h + ctx)


def make_pair(device: str, dtype: torch.dtype = torch.float32, depth: int = 6) -> tuple[Net, Net, torch.Tensor]:
    torch.manual_seed(0)
    reference = Net(depth=depth, dtype=dtype)
    offloaded = copy.deepcopy(reference)
    reference.to(device)
    for module in (offloaded.embed, offloaded.head):
        module.to(device)
    x = torch.randn(2, 5, 8, dtype=dtype, device=device)
    return reference, offloaded, x


ALIGN = 64


def map_blocks(model: nn.Module, path: Path) -> torch.Tensor:
    """Write the blocks' tensors into ``path`` back to back and point the blocks at views of its mapping,
    as the loader does with a .safetensors file (a quantized weight rebuilt over views of its parts); returns
    the mapping."""
    slots = [(module, table, name) for module in model.blocks.modules()
             for table in (module._parameters, module._buffers) for name, t in table.items() if t is not None]
    parts = [flatten(table[name]) for _, table, name in slots]
    offsets, cursor, chunks = [], 0, []
    for inner in (t for _, tensors in parts for t in tensors):
        data = inner.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        offsets.append(cursor)
        chunks.append(data + bytes(-len(data) % ALIGN))
        cursor += len(chunks[-1])
    path.write_bytes(b"".join(chunks))
    mapping = map_file(path)
    offsets = iter(offsets)
    for (module, table, name), (recipe, tensors) in zip(slots, parts):
        views = [mapping[o : o + t.nbytes].view(t.dtype).view(t.shape) for t, o in zip(tensors, offsets)]
        tensor = table[name]
        if recipe is None and isinstance(tensor, nn.Parameter):
            tensor.data = views[0]
        elif recipe is None:
            table[name] = views[0]
        else:
            with torch.inference_mode(tensor.is_inference()):
                rebuilt = recipe.rebuild(views)
                table[name] = nn.Parameter(rebuilt, requires_grad=False) if isinstance(tensor, nn.Parameter) else rebuilt
    return mapping


def mapped_pair(tmp_path: Path) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    reference, offloaded, x = make_pair("cpu")
    map_blocks(offloaded, tmp_path / "blocks.bin")
    return reference, offloaded, x


def host_bytes(model: nn.Module) -> int:
    """The bytes the blocks' groups hold, packed (what a host budget counts)."""
    probe = apply_group_offload(model, model.blocks, "cpu", host_budget=0)
    total = probe.stats()["host_bytes"]
    probe.remove()
    return total


aten = torch.ops.aten


class ScaledInt8(torch.Tensor):
    """A minimal quantized weight: int8 data and a float32 scale per row, in PyTorch's wrapper-subclass
    protocol; any op but the few it knows runs on the dequantized weight."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "ScaledInt8":
        scale = weight.abs().amax(dim=1, keepdim=True).float() / 127
        return cls((weight / scale).round().to(torch.int8), scale, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.float() * self.scale).to(self.dtype)

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return ScaledInt8(inner["qdata"], inner["scale"], context["dtype"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return ScaledInt8(args[0].qdata.detach(), args[0].scale.detach(), args[0].dtype)
        if func is aten._has_compatible_shallow_copy_type.default:
            return True
        if func is aten.copy_.default and isinstance(args[1], ScaledInt8):
            args[0].qdata.copy_(args[1].qdata)
            args[0].scale.copy_(args[1].scale)
            return args[0]
        plain = tree_map(lambda t: t.dequantize() if isinstance(t, ScaledInt8) else t, (args, kwargs))
        return func(*plain[0], **plain[1])


def _comfy_kitchen_fp8(weight: torch.Tensor) -> torch.Tensor:
    quantized = pytest.importorskip("comfy_kitchen.tensor.base")
    return quantized.QuantizedTensor.from_float(weight, "TensorCoreFP8Layout")


QUANTIZERS = {"scaled_int8": ScaledInt8.quantize, "comfy_kitchen_fp8": _comfy_kitchen_fp8}


def quantize_linears(model: nn.Module, quantize: Callable, inference: bool = True) -> None:
    """Every Linear weight of the blocks a quantized Parameter, made as ComfyUI makes its weights."""
    with torch.inference_mode(inference):
        for block in model.blocks:
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    module.weight = nn.Parameter(quantize(module.weight.detach()), requires_grad=False)


def quantized_pair(quantize: Callable, inference: bool = True):
    reference, offloaded, x = make_pair("cpu")
    for model in (reference, offloaded):
        quantize_linears(model, quantize, inference)
    return reference, offloaded, x
