"""Never out of memory mid-sampling (issue 20), on real ComfyUI: ``auto`` leaves the run's activations free,
and a diffusion-model call that runs out of GPU memory runs again with less of the model on the GPU.

The out-of-memory comes from the test node ``GroupOffloadTestOutOfMemory`` (testbed/comfy_testnodes): a
transformer block raises ``torch.OutOfMemoryError`` part-way through its forward, where an activation
that does not fit would. The "card" is the CPU, whose free and total memory ComfyUI is told
(``fake_cudart.give_device_memory``); ComfyUI's own memory estimate and load path run as they are.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch

from testbed.live_server import txt2img_workflow
from testbed.run_nodes import run_node, run_txt2img
from testbed.fake_cudart import give_device_memory
from testbed.pack_modules import pack_module
from testbed.node_runs import offload_handle, load_offloaded, load_plain, offload
from testbed.live_server import pixels, report_of, with_report

BACK_OFF_LINE = "the GPU ran out of memory"


def out_of_memory_at(model, block: int, failures: int = 1, after: int = 0):
    return run_node("GroupOffloadTestOutOfMemory", model=model, block=block, failures=failures, after=after).outputs[0]


def report(model, latent: torch.Tensor) -> dict:
    return run_node("GroupOffloadReport", model=model, samples={"samples": latent}).ui["group_offload"][0]


@pytest.mark.parametrize("block, prefetch", [(0, 1), (2, 1), (3, 2)])
@pytest.mark.parametrize("via", ["node", "loader"])
def test_an_out_of_memory_in_the_first_forward_backs_off_once_and_keeps_the_latent(models, caplog, via, block, prefetch):
    expected = run_txt2img(load_plain(), seed=7, steps=3).latent
    model = (offload(load_plain(), residency="auto", prefetch=prefetch) if via == "node"
             else load_offloaded(residency="auto", prefetch=prefetch))
    caplog.set_level(logging.WARNING)
    failing = out_of_memory_at(model, block)
    latent = run_txt2img(failing, seed=7, steps=3).latent
    assert torch.equal(latent, expected)
    stats = report(failing, latent)
    assert stats["back_offs"] == 1
    assert (stats["resident_groups"], stats["prefetch"]) == (0, prefetch), "4 groups' worth, then the buffers alone"
    assert sum(BACK_OFF_LINE in r.getMessage() for r in caplog.records) == 1, "said once per run"

    latent = run_txt2img(model, seed=7, steps=3).latent  # the next run plans afresh
    assert torch.equal(latent, expected)
    stats = report(model, latent)
    assert (stats["back_offs"], stats["resident_groups"]) == (0, 4), "ComfyUI on the CPU has room for all"


@pytest.mark.parametrize("residency", ["auto", "stream_all"])
def test_backing_off_in_a_later_step_under_the_stream_checker(models, checker, monkeypatch, residency):
    """The handle streams through the checker's runtime (a side stream, events, device allocations); the
    second step's forward runs out of memory at block 2, where every group streaming has the next
    groups' copies in flight and every group resident has its own device buffer to give back."""
    handles = pack_module("nodes.handles")
    monkeypatch.setattr(handles, "apply_group_offload", functools.partial(handles.apply_group_offload, runtime=checker))
    expected = run_txt2img(load_plain(), seed=7, steps=3).latent
    model = offload(load_plain(), residency=residency, prefetch=2)
    latent = run_txt2img(out_of_memory_at(model, block=2, after=1), seed=7, steps=3).latent
    assert torch.equal(latent, expected)
    stats = report(model, latent)
    assert (stats["back_offs"], stats["resident_groups"]) == (1, 0)
    assert stats["prefetch"] == (2 if residency == "auto" else 1), "every group streamed, then prefetch 1"
    assert checker.released > 0, "the freed buffers went back to the driver, checked"


def test_out_of_memory_under_every_plan_raises_what_was_tried_and_the_model_runs_on(models):
    expected = run_txt2img(load_plain(), seed=8).latent
    model = offload(load_plain(), residency="auto", prefetch=2)
    with pytest.raises(pack_module("offload_core").OutOfMemoryAfterBackOff) as raised:
        run_txt2img(out_of_memory_at(model, block=1, failures=100), seed=8)
    message = str(raised.value)
    assert [(r.resident_groups, r.prefetch) for r in raised.value.tried] == [(4, 2), (0, 2), (0, 1)]
    assert message.startswith("Group Offload: out of device memory under every plan it could fall back to: "
                              "4 of 4 groups resident, prefetch 2")
    assert "ComfyUI estimates this run's activations at" in message and "with prefetch 0 the model needs" in message
    assert torch.equal(run_txt2img(model, seed=8).latent, expected)
    assert offload_handle(model).residency().resident_groups == 4


def test_a_plain_models_out_of_memory_is_left_to_comfyui(models):
    with pytest.raises(torch.OutOfMemoryError, match="injected at transformer block 1") as raised:
        run_txt2img(out_of_memory_at(load_plain(), block=1), seed=9)
    assert not isinstance(raised.value, pack_module("offload_core").OutOfMemoryAfterBackOff)


# --- auto and the run's activations -----------------------------------------------------------

class Card:
    """The CPU as a card that holds the rest of the model, the streaming buffers and two and a half
    groups beside what ComfyUI keeps free for a run on a 64² latent; an offloaded model with auto."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import comfy.model_management as mm

        self.model = offload(load_plain(), residency="auto", prefetch=1)
        self.group_bytes = [g.nbytes for g in self.model.handle(torch.device("cpu")).groups]  # packs the host copies
        self.buffers = 2 * max(self.group_bytes)
        self.free = int(self.reserve(64) + self.buffers + 2.5 * self.group_bytes[0])
        give_device_memory(monkeypatch.setattr, free=self.free, total=self.free, device_type="cpu")
        mm.unload_all_models()

    def reserve(self, latent_side: int) -> float:
        """What auto keeps free for a run on this latent: the room ComfyUI's sampler asks before it runs cond
        and uncond as one call (1.5 × its estimate for them, samplers._calc_cond_batch) and its extra reserve."""
        import comfy.model_management as mm

        activations = self.model.model.memory_required([2, 16, latent_side, latent_side])
        return max(mm.minimum_inference_memory(), 1.5 * activations + mm.extra_reserved_memory())

    def sample(self, model, latent_side: int) -> torch.Tensor:
        return run_txt2img(model, seed=10, steps=1, width=8 * latent_side, height=8 * latent_side).latent


@pytest.fixture
def card(models, monkeypatch) -> Card:
    return Card(monkeypatch)


def test_a_four_times_larger_latent_keeps_fewer_groups_resident(card):
    resident = {}
    for latent_side in (64, 128):
        latent = card.sample(card.model, latent_side)
        room = max(0, int(card.free - card.reserve(latent_side) - card.buffers))
        plan = pack_module("offload_core").plan_residency(card.group_bytes, room)
        resident[latent_side] = report(card.model, latent)["resident_groups"]
        assert resident[latent_side] == plan.count(True), "the planner's plan for the room the run leaves"
    assert resident == {64: 2, 128: 0}


def test_the_error_names_the_latent_that_would_fit(card):
    with pytest.raises(pack_module("offload_core").OutOfMemoryAfterBackOff,
                       match=r"so a latent of about \d+% of this one's size would fit: lower the resolution"):
        card.sample(out_of_memory_at(card.model, block=0, failures=100), 128)


# --- through the server -----------------------------------------------------------------------

def test_out_of_memory_everywhere_reaches_the_history_and_the_server_keeps_serving(comfy_server):
    name = comfy_server.models.unet_name
    auto = {"blocks_per_group": 1, "prefetch": 1, "residency": "auto", "resident_gb": 0.0}
    workflow = txt2img_workflow(name, seed=71, model_patch=("GroupOffload", auto))
    workflow["11"] = {"class_type": "GroupOffloadTestOutOfMemory",
                      "inputs": {"model": ["10", 0], "block": 1, "failures": 100, "after": 0}}
    workflow["6"]["inputs"]["model"] = ["11", 0]
    entry = comfy_server.wait(comfy_server.queue(workflow), check=False)
    assert entry["status"]["status_str"] == "error"
    error = next(m[1] for m in entry["status"]["messages"] if m[0] == "execution_error")
    assert error["node_type"] == "KSampler"
    assert error["exception_type"].endswith("OutOfMemoryAfterBackOff")
    assert error["exception_message"].startswith("Group Offload: out of device memory under every plan it could "
                                                 "fall back to: 2 of 2 groups resident, prefetch 1")

    workflow = with_report(txt2img_workflow(name, seed=72, model_patch=("GroupOffload", auto), filename_prefix="oom"))
    entry = comfy_server.run(workflow)
    plain = comfy_server.run(txt2img_workflow(name, seed=72, filename_prefix="oom_plain"))
    assert np.array_equal(pixels(comfy_server, entry), pixels(comfy_server, plain))
    assert report_of(entry)["back_offs"] == 0
