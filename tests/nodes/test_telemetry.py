"""The websocket messages of nodes/telemetry.py: fields, rate limit, steps, and a real offloaded run.

The pack's modules are taken from ``sys.modules`` as ComfyUI loaded them (the pack is a package
named after its custom_nodes path; its ``nodes`` package is not the top-level ``nodes``, which is
ComfyUI's). Messages are captured by replacing the module's own ``send``; nothing of ComfyUI is
stubbed.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from testbed.comfy_boot import REPO_ROOT
from testbed.run_nodes import run_node, run_txt2img

# Every field of a message, for web/group_offload.js and web/group_offload_report.js to read.
FRONT_END_FIELDS = {
    "node_id", "final", "cpu_only", "groups", "resident_groups", "streamed_groups", "prefetch", "back_offs", "resident_bytes",
    "streamed_bytes_per_pass", "pinned_bytes", "host_bytes", "bytes_h2d", "bytes_d2h", "copies_h2d", "onloads", "sync_onloads",
    "compute_wait_ms", "hook_us_per_group", "formats", "host_dequantized_bytes_per_pass", "steps", "bytes_per_step",
    "h2d_gbps", "step_gbps", "packed_bytes", "in_place_bytes", "file_backed_bytes", "kept_cached_bytes", "host_limit",
    "gathered_bytes",
    "gathered_from_disk_bytes", "gathered_bytes_per_step", "gather_gbps", "read_ahead", "left_whole",
}


def pack_module(name: str) -> ModuleType:
    """``name`` (e.g. ``"nodes.telemetry"``) of this pack, as ComfyUI imported it."""
    relative = Path(*name.split("."))
    wanted = {(REPO_ROOT / relative).with_suffix(".py").resolve(), (REPO_ROOT / relative / "__init__.py").resolve()}
    for module_name, module in list(sys.modules.items()):
        # ComfyUI names the pack after its path; the top-level `offload_core` is the tests' own import.
        if module_name.endswith(f".{name}") and Path(getattr(module, "__file__", None) or "/").resolve() in wanted:
            return module
    raise LookupError(f"ComfyUI has not loaded {name} of this pack (is the pack's __init__.py importable?)")


@pytest.fixture
def telemetry(comfy) -> ModuleType:
    return pack_module("nodes.telemetry")


@pytest.fixture
def sent(telemetry, monkeypatch) -> list[dict]:
    """Every message the module sends, in order, instead of going to the (absent) server."""
    messages: list[dict] = []
    monkeypatch.setattr(telemetry, "send", messages.append)
    return messages


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(telemetry, monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(telemetry, "time", fake)
    return fake


class TinyDiT(nn.Module):
    """Three blocks to offload, called like a ComfyUI diffusion model."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def tiny_offloaded(comfy):
    """A TinyDiT whose blocks all stream (no residency, no prefetch), and its handle."""
    offload_core = pack_module("offload_core")
    model = TinyDiT()
    handle = offload_core.apply_group_offload(model, model.blocks, "cpu", prefetch=0, resident_bytes=0)
    yield model, handle
    handle.remove()


def _call(model: nn.Module) -> None:
    """One model call (a pass over all blocks)."""
    with torch.inference_mode():
        model(torch.ones(1, 16), torch.tensor([0.5]))


def _step(telemetry: ModuleType, model: nn.Module) -> None:
    """One model call, then the end of a sampling step, as ComfyUI's post-CFG function marks it."""
    _call(model)
    telemetry.step_done(model)


def _stats(**overrides) -> dict:
    stats = {
        "groups": 5, "resident_groups": 2, "resident_bytes": 2_000_000_000, "streamed_bytes_per_pass": 3_000_000_000,
        "bytes_h2d": 6_000_000_000, "bytes_d2h": 0, "copies_h2d": 12, "copies_d2h": 0, "onloads": 12,
        "sync_onloads": 1, "prefetches": 10, "compute_wait_ms": 12.5, "hook_us_per_group": 40.0,
        "hook_seconds": 0.01, "hook_calls": 250, "slab_bytes": 2_000_000_000, "host_bytes": 5_000_000_000,
        "pinned_bytes": 3_000_000_000, "prefetch": 1, "back_offs": 2, "packed_bytes": 4_000_000_000,
        "in_place_bytes": 1_000_000_000, "file_backed_bytes": 800_000_000, "kept_cached_bytes": 600_000_000, "gathers": 6,
        "gathered_bytes": 2_000_000_000, "gathered_from_disk_bytes": 500_000_000, "gather_seconds": 0.25,
        "read_ahead": 2,
    }
    return {**stats, **overrides}


def test_payload_has_the_fields_the_front_end_reads(telemetry):
    steps = [telemetry.StepSample(3_000_000_000, 1.5, 1_500_000_000),
             telemetry.StepSample(3_000_000_000, 0.5, 500_000_000)]
    payload = telemetry.telemetry_payload(_stats(), steps, "12", cpu_only=False, final=True,
                                          host_limit="cgroup v2 memory.max of /docker/abc")

    assert set(payload) == FRONT_END_FIELDS
    assert json.loads(json.dumps(payload)) == payload  # goes over the websocket as JSON
    assert payload["node_id"] == "12" and payload["final"] is True and payload["cpu_only"] is False
    assert (payload["groups"], payload["resident_groups"], payload["streamed_groups"]) == (5, 2, 3)
    assert (payload["prefetch"], payload["back_offs"]) == (1, 2)
    assert payload["resident_bytes"] == 2_000_000_000
    assert payload["streamed_bytes_per_pass"] == 3_000_000_000
    assert (payload["pinned_bytes"], payload["host_bytes"]) == (3_000_000_000, 5_000_000_000)
    assert (payload["bytes_h2d"], payload["bytes_d2h"], payload["copies_h2d"]) == (6_000_000_000, 0, 12)
    assert (payload["onloads"], payload["sync_onloads"]) == (12, 1)
    assert payload["compute_wait_ms"] == 12.5 and payload["hook_us_per_group"] == 40.0
    assert payload["steps"] == 2
    assert payload["bytes_per_step"] == 3_000_000_000
    assert payload["h2d_gbps"] == pytest.approx(6.0 / 2.0)  # 6 GB over the 2 s of both steps
    assert payload["step_gbps"] == [2.0, 6.0]
    assert (payload["packed_bytes"], payload["in_place_bytes"], payload["file_backed_bytes"]) == (
        4_000_000_000, 1_000_000_000, 800_000_000)
    assert (payload["kept_cached_bytes"], payload["host_limit"]) == (600_000_000, "cgroup v2 memory.max of /docker/abc")
    assert (payload["gathered_bytes"], payload["gathered_from_disk_bytes"]) == (2_000_000_000, 500_000_000)
    assert payload["gathered_bytes_per_step"] == 1_000_000_000  # of the steps' own gathers
    assert payload["gather_gbps"] == pytest.approx(2.0 / 0.25)  # over the gather time, not the steps'
    assert payload["read_ahead"] == 2  # the engine's lookahead, as it reports it


def test_payload_before_any_step_and_with_many_steps(telemetry):
    empty = telemetry.telemetry_payload(_stats(bytes_h2d=0), [], None, cpu_only=True, final=False)
    assert (empty["steps"], empty["bytes_per_step"], empty["h2d_gbps"], empty["step_gbps"]) == (0, 0.0, 0.0, [])
    assert empty["gathered_bytes_per_step"] == 0.0
    no_gathers = telemetry.telemetry_payload(_stats(gathered_bytes=0, gather_seconds=0.0), [], None, True, False)
    assert no_gathers["gather_gbps"] == 0.0
    assert empty["node_id"] is None and empty["cpu_only"] is True and empty["final"] is False

    many = [telemetry.StepSample(1_000_000 * (i + 1), 0.001) for i in range(telemetry.MAX_STEPS_SHOWN + 10)]
    payload = telemetry.telemetry_payload(_stats(), many, "3", cpu_only=False, final=True)
    assert payload["steps"] == telemetry.MAX_STEPS_SHOWN + 10
    assert len(payload["step_gbps"]) == telemetry.MAX_STEPS_SHOWN  # the latest steps
    assert payload["step_gbps"][-1] == round(many[-1].gbps, 3)
    assert payload["step_gbps"][0] == round(many[10].gbps, 3)
    assert telemetry.StepSample(5, 0.0).gbps == 0.0


def test_messages_are_rate_limited_over_a_burst(telemetry, sent, clock, tiny_offloaded):
    model, handle = tiny_offloaded
    telemetry.start_run(model, handle, "7", cpu_only=True)
    start = clock.now
    calls = 300
    for i in range(calls):  # one step every 10 ms for 3 s
        clock.now = start + i * 0.01
        _step(telemetry, model)
    telemetry.finish_run(model)

    live, final = sent[:-1], sent[-1]
    assert final["final"] is True and all(not m["final"] for m in live)
    seconds = 3.0
    assert len(live) <= telemetry.MAX_MESSAGES_PER_SECOND * seconds + 1
    assert len(live) >= telemetry.MAX_MESSAGES_PER_SECOND * seconds - 1  # and it does send live figures
    assert all(m["node_id"] == "7" for m in sent)
    assert final["steps"] == calls
    # Live messages only grow: each carries the steps closed so far.
    assert [m["steps"] for m in live] == sorted(m["steps"] for m in live)


def test_messages_are_rate_limited_in_real_time(telemetry, sent, tiny_offloaded):
    model, handle = tiny_offloaded
    telemetry.start_run(model, handle, None, cpu_only=True)
    started = time.perf_counter()
    for _ in range(200):
        _step(telemetry, model)
    elapsed = time.perf_counter() - started
    telemetry.finish_run(model)

    live = [m for m in sent if not m["final"]]
    assert 1 <= len(live) <= int(elapsed * telemetry.MAX_MESSAGES_PER_SECOND) + 1
    assert sum(m["final"] for m in sent) == 1


def test_steps_are_the_model_calls_between_step_ends(telemetry, sent, clock, tiny_offloaded):
    model, handle = tiny_offloaded
    per_pass = handle.stats()["streamed_bytes_per_pass"]
    assert per_pass > 0
    tick = 1e-6  # the tiny model moves a few KB per call: microsecond calls give GB/s that survive rounding

    telemetry.start_run(model, handle, "5", cpu_only=True)
    # Two steps of cond and uncond as two calls each, then a step of one call; each call takes a tick.
    for passes in (2, 2, 1):
        for _ in range(passes):
            clock.now += tick
            _call(model)
        telemetry.step_done(model)
    clock.now += 1.0  # what runs after the last step is no part of a step
    telemetry.finish_run(model)

    final = telemetry.last_run(model)
    assert final is sent[-1] and final["final"] is True
    assert final["steps"] == 3
    step_bytes = [2 * per_pass, 2 * per_pass, per_pass]
    step_seconds = [2 * tick, 2 * tick, tick]
    assert final["step_gbps"] == pytest.approx([b / s / 1e9 for b, s in zip(step_bytes, step_seconds)], abs=1e-3)
    assert final["bytes_h2d"] == sum(step_bytes)
    assert final["bytes_per_step"] == pytest.approx(sum(step_bytes) / 3)
    assert final["h2d_gbps"] == pytest.approx(sum(step_bytes) / (5 * tick) / 1e9)
    assert final["bytes_d2h"] == 0
    assert (final["groups"], final["streamed_groups"], final["resident_groups"]) == (3, 3, 0)


def test_groups_left_in_place_count_their_gathers_per_step(telemetry, sent, comfy):
    """With a host budget of 0 every group stays in place: each model call gathers one pass of them."""
    model = TinyDiT()
    handle = pack_module("offload_core").apply_group_offload(model, model.blocks, "cpu", prefetch=0, host_budget=0)
    try:
        per_pass = handle.stats()["in_place_bytes"]
        assert per_pass == handle.stats()["host_bytes"] > 0 and handle.stats()["packed_bytes"] == 0
        telemetry.start_run(model, handle, "6", cpu_only=True)
        for passes in (2, 1):
            for _ in range(passes):
                _call(model)
            telemetry.step_done(model)
        telemetry.finish_run(model)
    finally:
        handle.remove()
    final = telemetry.last_run(model)
    assert (final["packed_bytes"], final["in_place_bytes"]) == (0, per_pass)
    assert final["gathered_bytes"] == 3 * per_pass
    assert final["gathered_bytes_per_step"] == pytest.approx(1.5 * per_pass)
    assert final["gather_gbps"] > 0


def test_a_new_run_starts_from_zero(telemetry, sent, clock, tiny_offloaded):
    model, handle = tiny_offloaded
    for _ in range(2):
        telemetry.start_run(model, handle, "5", cpu_only=True)
        clock.now += 1.0
        _step(telemetry, model)
        telemetry.finish_run(model)
    first, second = [m for m in sent if m["final"]]
    assert first["steps"] == second["steps"] == 1
    assert first["bytes_h2d"] == second["bytes_h2d"] == handle.stats()["streamed_bytes_per_pass"]
    telemetry.finish_run(model)  # no run open: nothing happens, nothing is sent
    assert len([m for m in sent if m["final"]]) == 2


def test_offloaded_sampling_run_sends_a_final_payload_without_copy_back(comfy, comfy_models, telemetry, sent):
    (model,) = run_node("UNETLoader", unet_name=comfy_models.unet_name, weight_dtype="default").outputs
    (offloaded,) = run_node("GroupOffload", model=model, blocks_per_group=1, prefetch=1, residency="stream_all",
                            resident_gb=0.0, unique_id="42").outputs
    steps = 3
    result = run_txt2img(offloaded, None, seed=3, steps=steps)

    final = sent[-1]
    assert final["final"] is True and sum(m["final"] for m in sent) == 1
    assert set(final) == FRONT_END_FIELDS
    assert final["node_id"] == "42"
    assert final["cpu_only"] is (not torch.cuda.is_available())
    assert final["bytes_d2h"] == 0
    assert final["steps"] == steps
    assert final["groups"] == final["streamed_groups"] == 2 and final["resident_groups"] == 0
    assert (final["prefetch"], final["back_offs"]) == (1, 0)
    assert final["bytes_h2d"] > 0
    # Every step streams every group; prefetch=1 also copies the next pass's first group ahead, which
    # after the last step is one group that no pass uses.
    per_pass = final["streamed_bytes_per_pass"]
    assert steps * per_pass <= final["bytes_h2d"] < (steps + 1) * per_pass
    assert final["bytes_per_step"] * steps == pytest.approx(final["bytes_h2d"])
    assert len(final["step_gbps"]) == steps
    assert json.loads(json.dumps(final)) == final

    # The report node shows exactly that message.
    report = run_node("GroupOffloadReport", model=offloaded, samples={"samples": result.latent})
    assert report.ui == {"group_offload": [final]}
