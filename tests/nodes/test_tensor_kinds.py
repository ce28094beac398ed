"""Every block weight keeps the tensor kind ComfyUI gave it, through every layout the pack puts it in.

torch picks kernels by what a weight is, not only by its values: an inference tensor or not, requiring
grad or not, a Parameter or a buffer, its strides. On an AVX-512 CPU a weight that became an inference
tensor made ``at::matmul`` run a batched SGEMM instead of one flattened SGEMM (Qwen's ``to_out`` on a
slice of the joint attention), rounding differently from ComfyUI; cuBLAS has the same choice. So the
weights are compared as each block's layers see them while they compute, with and without the pack:
packed mirrors, device slabs, resident buffers and file pages alike, loaded inside a prompt (inference
mode, as ComfyUI's executor runs every node) and outside one (a script, another pack's node).

A quantized weight is more than its outer tensor: a comfy-kitchen ``QuantizedTensor`` computes with its inner
tensors (data and scales, each with its own kind) and its flatten context (layout, params class and fields),
a ComfyUI-GGUF ``GGMLTensor`` with its bytes and attributes. Those are part of its kind, for every quantized
layout ComfyUI loads, through the node and the loader.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from testbed import gguf_files, gguf_runs, quantized_files
from testbed.comfy_boot import comfyui_version
from testbed.run_nodes import run_txt2img
from testbed.node_runs import DEVICES
from testbed.node_runs import load_offloaded, load_plain, offload

#: what a weight is, to the kernels that read it: its own kind, then its parts' (``_parts``)
Kind = tuple[str, bool, bool, bool, torch.dtype, tuple[int, ...], str, tuple]

LAYOUTS = {
    "streamed": {"residency": "stream_all", "prefetch": 1},
    "synchronous": {"residency": "stream_all", "prefetch": 0},
    "resident": {"residency": "budget", "resident_gb": 1.0},
    "in place": {"residency": "stream_all", "host_memory": "budget", "host_gb": 0.0},
}


def _kind(tensor: torch.Tensor, is_param: bool) -> Kind:
    return (type(tensor).__name__, is_param, tensor.requires_grad, tensor.is_inference(), tensor.dtype, tensor.stride(),
            tensor.device.type, _parts(tensor))


def _parts(tensor: torch.Tensor) -> tuple:
    """What a quantized weight computes with besides its outer tensor: a wrapper subclass's inner tensors, by
    name, each with its kind, and its flatten context; a plain subclass's attributes (GGUF's type and shape)."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        names, context = tensor.__tensor_flatten__()
        return (*((name, _kind(getattr(tensor, name), False)) for name in names), repr(context))
    return tuple(sorted((name, repr(value)) for name, value in vars(tensor).items() if not name.startswith("_")))


@contextlib.contextmanager
def kinds_seen_by_the_layers(model) -> Iterator[dict[str, set[Kind]]]:
    """Each block weight's kinds, as its layer sees it at every forward while the context is open."""
    blocks: nn.Module = model.model.diffusion_model.transformer_blocks
    seen: dict[str, set[Kind]] = {}

    def record(prefix: str):
        def hook(module: nn.Module, args) -> None:
            for name, param in module._parameters.items():
                if param is not None:
                    seen.setdefault(prefix + name, set()).add(_kind(param, True))
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    seen.setdefault(prefix + name, set()).add(_kind(buffer, False))
        return hook

    handles = [module.register_forward_pre_hook(record(f"{name}."))
               for name, module in blocks.named_modules() if module._parameters or module._buffers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _sampled_kinds(model) -> dict[str, set[Kind]]:
    with kinds_seen_by_the_layers(model) as seen:
        run_txt2img(model, seed=3, steps=2)
    assert seen, "the blocks' layers ran"
    return seen


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("in_prompt", [True, False], ids=["loaded in a prompt", "loaded outside one"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("via", ["node", "loader"])
def test_weights_keep_their_kind(models, device, via, layout, in_prompt):
    options = LAYOUTS[layout]
    if via == "node" and "host_memory" in options:
        options = {**options, "host_memory": "auto"}  # the node's blocks are in RAM already: packed
    loading = torch.inference_mode() if in_prompt else contextlib.nullcontext()
    with loading:
        expected = _sampled_kinds(load_plain())
    with loading:
        model = offload(load_plain(), **options) if via == "node" else load_offloaded(**options)
    for _ in range(2):  # the first run builds the layouts, the second reuses them
        seen = _sampled_kinds(model)
        changed = {name: (expected.get(name), kinds) for name, kinds in seen.items() if kinds != expected.get(name)}
        assert not changed, f"{len(changed)} weights changed kind (without -> with the pack), e.g. {min(changed.items())}"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("via", ["node", "loader"])
def test_fp8_weights_keep_their_kind(models, device, via):
    with torch.inference_mode():
        expected = _sampled_kinds(load_plain("fp8_e4m3fn"))
        model = offload(load_plain("fp8_e4m3fn")) if via == "node" else load_offloaded("fp8_e4m3fn")
    assert _sampled_kinds(model) == expected


QUANTIZED = {"fp8 scaled": "scaled_fp8", "comfy_quant fp8": "float8_e4m3fn", "int8 tensorwise": "int8_tensorwise",
             "nvfp4": "nvfp4", "mxfp8": "mxfp8"}


def _loads_quantized(fmt: str, via: str) -> None:
    """Skip where this ComfyUI cannot sample ``fmt`` on the CPU, or the loader refuses it (0.3.75's quantized
    layers keep their scales under no keys of their own: see test_quantized)."""
    reason = quantized_files.cpu_skip_reason(fmt)
    if reason is None and via == "loader" and comfyui_version() == "0.3.75":
        reason = "ComfyUI 0.3.75's quantized layers are refused by the loader, and go through the node"
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("via", ["node", "loader"])
@pytest.mark.parametrize("fmt", QUANTIZED.values(), ids=QUANTIZED.keys())
def test_quantized_weights_and_their_parts_keep_their_kind(quantized_models, device, fmt, via, layout):
    _loads_quantized(fmt, via)
    options = LAYOUTS[layout]
    if via == "node" and "host_memory" in options:
        options = {**options, "host_memory": "auto"}
    expected = _sampled_kinds(quantized_files.load_plain(fmt))
    model = (quantized_files.offload(quantized_files.load_plain(fmt), **options) if via == "node"
             else quantized_files.load_offloaded(fmt, **options))
    for _ in range(2):
        seen = _sampled_kinds(model)
        changed = {name: (expected.get(name), kinds) for name, kinds in seen.items() if kinds != expected.get(name)}
        assert not changed, f"{len(changed)} weights changed kind (without -> with the pack), e.g. {min(changed.items())}"


@pytest.mark.skipif(gguf_files.comfyui_gguf_missing() is not None, reason=str(gguf_files.comfyui_gguf_missing()))
@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gguf_weights_keep_their_kind(gguf_models, device, layout):
    options = {**LAYOUTS[layout], "host_memory": "auto"}  # ComfyUI-GGUF's blocks: through the node only
    expected = _sampled_kinds(gguf_runs.load_gguf("qwen_image"))
    model = gguf_runs.offload(gguf_runs.load_gguf("qwen_image"), **options)
    for _ in range(2):
        assert _sampled_kinds(model) == expected
