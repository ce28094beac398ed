"""The offloaded model inside ComfyUI's memory compiler (v0.35+: comfy-aimdo's allocation graph, opened by
Qwen-Image 2.1, MiniMax H3 and LTX-AV in their forward), against the stand-in of ``memory_compiler``: a call
that runs out of memory part-way leaves the graph open; the back-off closes it before the call runs again
(the same output, bit for bit), takes comfy-aimdo's compile error for an out-of-memory, and the streaming
buffers are made outside the graph (no rogue allocations).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from testbed import call_pattern_models as stand_ins
from testbed import memory_compiler
from testbed.call_pattern_models import HOST, handle_for, with_stand_in
from testbed.dit_families import noise, text
from testbed.node_runs import DEVICES
from testbed.pack_modules import pack_module
from testbed.run_nodes import run_node

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "auto", "resident_gb": 0.0}  # (a plan to fall back from)


class CompilingModel(stand_ins._StandIn):
    """Opens the memory compiler around its blocks, a scope per block, as Qwen-Image 2.1's forward does;
    ``failures`` calls of block ``fail_at`` raise ``error()`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(stand_ins.DiTBlock() for _ in range(4))
        self.failures, self.fail_at, self.error = 0, 2, lambda: torch.OutOfMemoryError("CUDA out of memory")

    def run_blocks(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        import comfy.model_prefetch as prefetch

        prefetch.malloc_graph_begin(tokens.device)
        for i, block in enumerate(self.transformer_blocks):
            prefetch.prefetch_queue_pop(None, tokens.device, block, malloc_scope="block")
            if i == self.fail_at and self.failures:
                self.failures -= 1
                raise self.error()
            tokens = block(tokens, context)
        prefetch.prefetch_queue_pop(None, tokens.device, None, malloc_scope="block")
        prefetch.malloc_graph_end()
        return tokens


def sampled(patcher) -> torch.Tensor:
    """One diffusion-model call through ComfyUI's ``APPLY_MODEL`` wrappers (the node's back-off among them)."""
    import comfy.model_management as mm
    import comfy.patcher_extension

    mm.load_models_gpu([patcher])
    options = {"wrappers": comfy.patcher_extension.copy_nested_dicts(patcher.wrappers)}  # as ComfyUI's sampler does
    device = mm.get_torch_device()  # (where ComfyUI's sampler puts the latent and the conditioning)
    with torch.inference_mode():
        return patcher.model.apply_model(noise(*HOST.latent, seed=5).to(device),
                                         torch.full(HOST.latent[:1], 0.7, device=device),
                                         c_crossattn=text().to(device), transformer_options=options)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("error", [lambda: torch.OutOfMemoryError("CUDA out of memory"),
                                   lambda: RuntimeError(memory_compiler.COMPILE_ERROR)],
                         ids=["out_of_memory", "aimdo_compile_error"])
def test_the_back_off_closes_the_half_open_compiler_and_runs_the_call_again(monkeypatch, error, device):
    """On a GPU, the node-level twin: the same with ComfyUI on CUDA, the handle's ComfyCudaRuntime streaming
    into real device buffers (made with the graph paused), the error raised part-way through a streamed call."""
    import comfy.model_management as mm

    compiler = memory_compiler.install(monkeypatch)
    model = CompilingModel()
    plain = with_stand_in(model)
    expected = sampled(plain)
    assert len(compiler.graphs) == 1 and compiler.open_graph() is None, "a call that ends closes its frame"
    compiler.cleanup_malloc_graph()  # (as ComfyUI does when sampling ends)
    offloaded = run_node("GroupOffload", model=plain, **OFFLOAD).outputs[0]
    model.failures, model.error = 1, error
    try:
        assert torch.equal(sampled(offloaded), expected)
        failed, retried = compiler.graphs[-2:]
        assert failed.aborted, "the graph the failed call left open was closed before the call ran again"
        assert not retried.aborted and compiler.open_graph() is None
        stats = handle_for(model).stats()
        assert stats["back_offs"] == 1 and stats["bytes_d2h"] == 0
        assert torch.equal(sampled(offloaded), expected), "and the next call, as it was"
    finally:
        mm.unload_all_models()


def test_a_plain_error_is_not_taken_for_an_out_of_memory(comfy, monkeypatch):
    import comfy.model_management as mm

    memory_compiler.install(monkeypatch)
    model = CompilingModel()
    offloaded = run_node("GroupOffload", model=with_stand_in(model), **OFFLOAD).outputs[0]
    model.failures, model.error = 1, lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    try:
        with pytest.raises(RuntimeError, match="^mat1 and mat2"):
            sampled(offloaded)
        assert handle_for(model).stats()["back_offs"] == 0
    finally:
        mm.unload_all_models()


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_buffers_are_made_outside_an_open_compiler(comfy, monkeypatch, device):
    """ComfyCudaRuntime (the handle's runtime on a GPU) allocates its buffers with the graph paused, so
    that they are no rogue allocations of it; with no graph open, it allocates as torch does."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    compiler = memory_compiler.install(monkeypatch)
    runtime = pack_module("nodes.compiler").ComfyCudaRuntime(torch.device(device))
    paused_at_allocation = []
    allocate = torch.empty

    def recording_empty(*args, **kwargs):
        graph = compiler.open_graph()
        paused_at_allocation.append(graph is not None and graph.paused > 0)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    runtime.empty(64)
    compiler.malloc_graph_begin(torch.device(device))
    slab = runtime.empty(64)
    graph = compiler.open_graph()
    compiler.malloc_graph_end()
    assert paused_at_allocation == [False, True] and graph.paused == 0
    assert slab.device.type == device and slab.numel() == 64
