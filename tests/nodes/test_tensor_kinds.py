"""Every block weight keeps the tensor kind ComfyUI gave it, through every layout the pack puts it in.

torch picks kernels by what a weight is, not only by its values: an inference tensor or not, requiring
grad or not, a Parameter or a buffer, its strides. On an AVX-512 CPU a weight that became an inference
tensor made ``at::matmul`` run a batched SGEMM instead of one flattened SGEMM (Qwen's ``to_out`` on a
slice of the joint attention), rounding differently from ComfyUI; cuBLAS has the same choice. So the
weights are compared as each block's layers see them while they compute, with and without the pack:
packed mirrors, device slabs, resident buffers and file pages alike, loaded inside a prompt (inference
mode, as ComfyUI's executor runs every node) and outside one (a script, another pack's node).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from testbed.run_nodes import run_txt2img
from testbed.node_runs import DEVICES
from testbed.node_runs import load_offloaded, load_plain, offload

#: what a weight is, to the kernels that read it
Kind = tuple[str, bool, bool, bool, torch.dtype, tuple[int, ...], str]

LAYOUTS = {
    "streamed": {"residency": "stream_all", "prefetch": 1},
    "synchronous": {"residency": "stream_all", "prefetch": 0},
    "resident": {"residency": "budget", "resident_gb": 1.0},
    "in place": {"residency": "stream_all", "host_memory": "budget", "host_gb": 0.0},
}


def _kind(tensor: torch.Tensor, is_param: bool) -> Kind:
    return (type(tensor).__name__, is_param, tensor.requires_grad, tensor.is_inference(), tensor.dtype, tensor.stride(),
            tensor.device.type)


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
