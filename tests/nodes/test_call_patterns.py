"""Models that call their blocks other than through one ``forward`` per block per call (stand-ins of newer
ComfyUI's Prism, SenseNova-U1.5, Qwen-Image 2.1 and Kandinsky 6, see ``call_pattern_models``), through the
Group Offload node on real ComfyUI: each call bit-identical to the model without the node, and every call
that runs blocks copies at least their bytes to the device (the transfer ledger counts them); a model that
reads a block's weight from its own code is named at that read, before it computes anything from it.
"""
from __future__ import annotations

import pytest
import torch

from testbed import call_pattern_models as stand_ins
from testbed.run_nodes import run_node
from testbed.call_pattern_models import call, handle_for, with_stand_in

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
CALLS = 4


def sent_bytes(model: torch.nn.Module) -> int:
    handle = handle_for(model)
    return 0 if handle is None else handle.stats()["bytes_h2d"]


def streamed_bytes(handle) -> int:
    return sum(g.nbytes for g in handle.groups if not g.resident)


def reset(model: torch.nn.Module) -> None:
    """The stand-in's own state back to a fresh model's (the caches of Qwen-Image 2.1 and Kandinsky 6)."""
    if isinstance(model, stand_ins.QwenImage21Like):
        model.prefix_cache.clear()
    if isinstance(model, stand_ins.Kandinsky6Like):
        model.calls, model.residual = 0, None
    if isinstance(model, stand_ins.SenseNovaLike):
        model.calls = 0  # (its kv_cache stays: the same weights and context computed it)


PATTERNS = {
    "prism_parts_called_directly": (stand_ins.PrismLike, {}),
    "sensenova_other_methods": (stand_ins.SenseNovaLike, {}),
    "sensenova_precomputed_prefix_first": (stand_ins.SenseNovaLike, {"cached": {0, 2}}),
    "qwen_image21_blocks_twice": (stand_ins.QwenImage21Like, {}),
    "qwen_image21_blocks_twice_grouped": (stand_ins.QwenImage21Like, {"blocks_per_group": 2}),
    "kandinsky6_skipped_calls": (stand_ins.Kandinsky6Like, {"skip": {1, 3}}),
    "kandinsky6_first_call_skipped": (stand_ins.Kandinsky6Like, {"skip": {0, 2}, "residual": True}),
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_call_pattern_streams_bit_identically(comfy, pattern):
    import comfy.model_management as mm

    make, options = PATTERNS[pattern]
    model = make()
    plain = with_stand_in(model)
    skip = options.get("skip", set())
    if skip:
        model.skip_calls = skip
    if options.get("cached"):  # a prefix precomputed before the first call (SenseNovaGenerate's)
        call(plain, 0)
        model.cached_calls = options["cached"]
        reset(model)
    seed_residual = (lambda: setattr(model, "residual", torch.zeros(1, 1, stand_ins.WIDTH))) \
        if options.get("residual") else (lambda: None)
    seed_residual()
    expected = [call(plain, step) for step in range(CALLS)]
    reset(model)
    seed_residual()
    settings = {**OFFLOAD, **{k: v for k, v in options.items() if k in OFFLOAD}}
    offloaded = run_node("GroupOffload", model=plain, **settings).outputs[0]
    try:
        for step in range(CALLS):
            before = sent_bytes(model)
            assert torch.equal(call(offloaded, step), expected[step]), f"call {step}"
            sent, handle = sent_bytes(model) - before, handle_for(model)
            if step not in skip or step == 0 and not options.get("residual"):
                assert sent >= streamed_bytes(handle), f"call {step} sent {sent} of {streamed_bytes(handle)} bytes"
        assert handle.stats()["streamed_bytes_per_pass"] == streamed_bytes(handle) > 0
        if options.get("cached"):
            assert "forward_prefix" in vars(model.layers[0]), "a block method the first call skipped stays an entry"
        assert handle.stats()["bytes_d2h"] == 0
    finally:
        mm.unload_all_models()


def test_the_learnt_entries_leave_a_forward_block_as_before(comfy):
    """After the first call, a block run through its ``forward`` keeps no entry on the modules inside it
    (each would break a compiled block's graph); Prism's parts, called one by one, keep theirs."""
    import comfy.model_management as mm

    model = stand_ins.PrismLike()
    offloaded = run_node("GroupOffload", model=with_stand_in(model), **OFFLOAD).outputs[0]
    try:
        call(offloaded, 0)
        fused = model.fusion_blocks[0]
        assert "forward" in vars(fused.a2v_conditioner) and "forward" in vars(fused.audio_block)
        inner = (fused.audio_block.mlp, model.remaining_video_blocks[0].mlp)
        assert not any("forward" in vars(module) for module in inner)
    finally:
        mm.unload_all_models()


def test_a_weight_read_outside_its_block_is_named_before_it_is_used(comfy):
    import comfy.model_management as mm

    model = stand_ins.OutsideUseLike()
    offloaded = run_node("GroupOffload", model=with_stand_in(model), **OFFLOAD).outputs[0]
    try:
        named = (r"^Group Offload: OutsideUseLike uses diffusion_model\.blocks\.0\.up\.weight of its transformer "
                 r"blocks without calling the block or a module in it.*connect the model to the sampler without "
                 r"Group Offload$")
        with pytest.raises(RuntimeError, match=named):
            call(offloaded, 0)
    finally:
        mm.unload_all_models()
