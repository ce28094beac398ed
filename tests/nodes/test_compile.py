"""torch.compile on an offloaded model, on real ComfyUI with inductor on the CPU.

ComfyUI's TorchCompileModel (the whole diffusion model) and per-block compilation as KJNodes' compile
nodes do it (each transformer block, through ComfyUI's own compile wrapper), in either order with
Group Offload or its loader: the same latents as the compiled model without offloading, nothing
compiled again once warm, and no compiled graph left computing with old weights after a LoRA change
or ``POST /free``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from testbed.run_nodes import run_node, run_txt2img
from testbed.lora_fixture import make_lora
from offload_core import apply_group_offload
from testbed.core_models import make_pair
from testbed.node_runs import load_offloaded, load_plain, offload, with_lora


def _cpp_compiler() -> str | None:
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except (exc.InvalidCxxCompiler, RuntimeError):
        return None


pytestmark = pytest.mark.skipif(_cpp_compiler() is None,
                                reason="inductor on the CPU needs a C++ compiler (g++ or clang++, or set CXX)")

SEED, STEPS = 7, 2


@pytest.fixture(scope="module", autouse=True)
def pytorch_attention(comfy) -> Iterator[None]:
    """Qwen-Image attends with PyTorch's SDPA, as ComfyUI does on a GPU (``--use-pytorch-cross-attention``).

    ComfyUI's CPU default (sub-quadratic attention) sizes its chunks from the host's free memory at every
    call, and torch.compile guards on that number: a warm run then recompiles whenever free RAM moves.
    """
    import comfy.ldm.modules.attention
    import comfy.ldm.qwen_image.model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comfy.ldm.qwen_image.model, "optimized_attention_masked",
                      comfy.ldm.modules.attention.attention_pytorch)
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts with no compiled code (inductor's on-disk cache still spares recompiling kernels)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_model(model):
    """ComfyUI's TorchCompileModel node: the whole diffusion model."""
    return run_node("TorchCompileModel", model=model, backend="inductor").outputs[0]


def compile_blocks(model):
    """Per-block compilation as KJNodes' compile nodes do it: every transformer block, through ComfyUI's wrapper."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = model.clone()
    blocks = compiled.get_model_object("diffusion_model").transformer_blocks
    set_torch_compile_wrapper(model=compiled, backend="inductor",
                              keys=[f"diffusion_model.transformer_blocks.{i}" for i in range(len(blocks))])
    return compiled


@contextlib.contextmanager
def nothing_compiled() -> Iterator[None]:
    """Fail if torch.compile compiles a frame, or recompiles one, inside the block."""
    before = counters["frames"]["total"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    assert counters["frames"]["total"] == before, "torch.compile compiled a new frame once warm"


def latent(model) -> torch.Tensor:
    return run_txt2img(model, seed=SEED, steps=STEPS).latent


COMPILERS = {"whole_model": compile_model, "per_block": compile_blocks}


@pytest.fixture(scope="module", params=COMPILERS)
def compiler(request: pytest.FixtureRequest):
    return COMPILERS[request.param]


@pytest.fixture(scope="module")
def compiled_reference(models, compiler) -> torch.Tensor:  # noqa: F811
    """The latent of the same model compiled the same way, without offloading."""
    torch._dynamo.reset()
    return latent(compiler(load_plain()))


@pytest.mark.parametrize("granularity", ["model", "blocks"])
def test_offload_core_compiles_once_on_a_plain_torch_model(granularity):
    """offload_core alone (as diffusers users would apply it): six blocks streamed through two slabs."""
    reference, offloaded, x = make_pair("cpu")
    apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1)
    if granularity == "model":
        reference, offloaded = torch.compile(reference), torch.compile(offloaded)
    else:
        for block in (*reference.blocks, *offloaded.blocks):
            block.compile()
    with torch.inference_mode():
        expected = reference(x)
        compare = torch.equal if granularity == "blocks" else torch.allclose  # a whole graph fuses across blocks
        assert compare(offloaded(x), expected)
        with nothing_compiled():
            for _ in range(2):
                assert compare(offloaded(x), expected)


GRAPHS = {
    # loader -> TorchCompileModel; all four groups streamed through two slabs
    "loader_then_compile": lambda compile_: compile_(load_offloaded(prefetch=1)),
    # TorchCompileModel -> Group Offload; one group resident, the rest streamed
    "compile_then_offload": lambda compile_: offload(compile_(load_plain()), residency="budget", resident_gb=0.0003),
}


@pytest.mark.parametrize("graph", GRAPHS)
def test_compiled_offload_matches_and_compiles_once(models, compiler, compiled_reference, graph):  # noqa: F811
    model = GRAPHS[graph](compiler)
    assert torch.equal(latent(model), compiled_reference)
    with nothing_compiled():
        assert torch.equal(latent(model), compiled_reference)


def test_lora_strength_change_computes_with_the_new_weights(models):  # noqa: F811
    compiled_offloaded = offload(compile_model(load_plain()))
    compiled_plain = compile_model(load_plain())
    eager_offloaded = offload(load_plain())
    results = {}
    for strength in (0.8, 0.3):
        results[strength] = latent(with_lora(compiled_offloaded, strength))
        assert torch.equal(results[strength], latent(with_lora(compiled_plain, strength)))
        torch.testing.assert_close(results[strength], latent(with_lora(eager_offloaded, strength)), rtol=1e-4, atol=1e-4)
    assert (results[0.8] - results[0.3]).abs().max() > 1e-2, "the strength must change the result"


def saved_latent(server, entry: dict, node: str) -> torch.Tensor:
    (saved,) = entry["outputs"][node]["latents"]
    return load_file(str(server.output_dir / saved["subfolder"] / saved["filename"]))["latent_tensor"]


def test_free_and_lora_change_leave_no_stale_graph(comfy_server):
    """UNETLoader -> TorchCompileModel -> Group Offload -> LoRA -> KSampler -> SaveLatent, over the HTTP API."""
    from testbed.live_server import OFFLOAD

    lora = "tiny_qwen_lora_compile.safetensors"
    make_lora(comfy_server.models.models_dir / "diffusion_models" / comfy_server.models.unet_name,
              comfy_server.models.models_dir / "loras" / lora)

    def workflow(strength: float, compiled: bool) -> dict:
        nodes = {
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": comfy_server.models.unet_name, "weight_dtype": "default"}},
            "2": {"class_type": "TorchCompileModel", "inputs": {"model": ["1", 0], "backend": "inductor"}},
            "3": {"class_type": "GroupOffload", "inputs": {"model": ["2" if compiled else "1", 0], **OFFLOAD}},
            "4": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["3", 0], "lora_name": lora, "strength_model": strength}},
            "5": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "joint_dim": 64}},
            "6": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 2, "tokens": 8, "joint_dim": 64}},
            "7": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            "8": {"class_type": "KSampler", "inputs": {
                "model": ["4", 0], "seed": SEED, "steps": STEPS, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
                "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
            "9": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "latents/compile"}},
        }
        return nodes if compiled else {k: v for k, v in nodes.items() if k != "2"}

    def run(strength: float, compiled: bool = True) -> torch.Tensor:
        return saved_latent(comfy_server, comfy_server.run(workflow(strength, compiled), timeout=600), "9")

    strong = run(0.8)
    assert comfy_server.post("/free", {"unload_models": True, "free_memory": False})[0] == 200
    weak = run(0.3)  # the same compiled model (cached node outputs), a new handle, other LoRA weights
    torch.testing.assert_close(weak, run(0.3, compiled=False), rtol=1e-4, atol=1e-4)
    assert (weak - strong).abs().max() > 1e-2, "the strength must change the result"


@pytest.mark.parametrize("settings", [{"backend": "cudagraphs"}, {"backend": "inductor", "mode": "reduce-overhead"}])
def test_cuda_graphs_are_refused_by_name(models, settings):  # noqa: F811
    """A CUDA graph replays recorded weight addresses; streamed groups change buffers (issue 25, item 6)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    compiled = offload(load_plain())
    set_torch_compile_wrapper(model=compiled, **settings)
    with pytest.raises(ValueError, match="cannot run a model compiled with CUDA graphs .*use the inductor backend"):
        latent(compiled)


@pytest.mark.cuda
def test_cuda_graphs_of_compiled_blocks_replay_bit_identically_on_streamed_weights():
    """Below the node (which refuses these modes: every step would record again), torch.compile's CUDA graphs
    (mode "reduce-overhead") capture each compiled block between the offloading's hooks, which it leaves out; a
    block whose weights lie in another device buffer than at its capture is recorded again (torch's check of its
    static inputs' addresses, read in torch 2.14's cudagraph_trees.py), never replayed on stale addresses. Every
    group streamed: the same outputs, call after call, as the model compiled the same way without offloading."""
    reference, offloaded, x = make_pair("cuda")
    handle = apply_group_offload(offloaded, offloaded.blocks, "cuda", prefetch=1)
    for model in (reference, offloaded):
        for block in model.blocks:
            block.compile(mode="reduce-overhead")
    with torch.inference_mode():
        for _ in range(4):  # warm-up, capture, then replays
            expected = reference(x).clone()  # (a replay's output is overwritten by the next one)
            assert torch.equal(offloaded(x).clone(), expected)
    stats = handle.stats()
    assert stats["bytes_h2d"] >= 4 * stats["streamed_bytes_per_pass"] > 0 and stats["bytes_d2h"] == 0
