"""Nothing outlives its model: handles and host mirrors go when their model can no longer be reached,
whatever way that happens; their device copies go at once on unload, and everything at once on
``POST /free`` with ``free_memory``."""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import torch
from PIL import Image
from torch import nn

from testbed.live_server import txt2img_workflow
from testbed.run_nodes import run_node
from offload_core import apply_group_offload, handle_of

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
LIVE = "99"


# --- offload_core on its own ------------------------------------------------------------------

def _net() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))


def test_an_unreachable_model_takes_its_handle_with_it():
    model = _net()
    handle = weakref.ref(apply_group_offload(model, list(model), "cpu"))
    assert handle_of(model[0]) is handle()
    model(torch.randn(2, 16))
    del model
    gc.collect()
    assert handle() is None


def test_remove_frees_the_handle_without_waiting_for_the_garbage_collector():
    model = _net()
    handle = apply_group_offload(model, list(model), "cpu")
    handle_ref = weakref.ref(handle)
    model(torch.randn(2, 16))
    gc.disable()
    try:
        handle.remove()
        del handle
        assert handle_ref() is None and handle_of(model[0]) is None
    finally:
        gc.enable()
    assert apply_group_offload(model, list(model), "cpu") is not None, "the blocks can be offloaded again"


# --- in-process ComfyUI ----------------------------------------------------------------------

def test_a_model_collected_together_with_its_patcher_still_has_its_handle_removed(comfy_models):
    model = run_node("GroupOffloadLoader", unet_name=comfy_models.unet_name, weight_dtype="default", **OFFLOAD).outputs[0]
    block = model.model.diffusion_model.transformer_blocks[0]
    assert "forward" in block.__dict__
    model.cycle = model  # patcher and model now go in one garbage collection, not one by one
    del model
    gc.collect()
    assert "forward" not in block.__dict__, "removed (pinned memory given back), not just dropped with the model"


# --- through the server -----------------------------------------------------------------------

def run_counted(server, workflow: dict | None = None, **inputs) -> tuple[dict, dict]:
    """Run ``workflow`` (default: nothing else) with the live-object counter wired to ``inputs``;
    returns the /history entry and the counts."""
    workflow = dict(workflow or {})
    workflow[LIVE] = {"class_type": "GroupOffloadTestLiveObjects", "inputs": inputs}
    entry = server.run(workflow)
    return entry, entry["outputs"][LIVE]["live"][0]


def live(server, workflow: dict | None = None, **inputs) -> dict:
    return run_counted(server, workflow, **inputs)[1]


def loader_workflow(name: str, seed: int, **options) -> dict:
    workflow = txt2img_workflow(name, seed=seed, filename_prefix="lifetimes")
    workflow["1"] = {"class_type": "GroupOffloadLoader",
                     "inputs": {"unet_name": name, "weight_dtype": "default", **(OFFLOAD | options)}}
    return workflow


def node_workflow(name: str, seed: int, **options) -> dict:
    return txt2img_workflow(name, seed=seed, model_patch=("GroupOffload", OFFLOAD | options), filename_prefix="lifetimes")


def assert_nothing_left(server) -> None:
    counts = live(server)
    assert counts | {"rss_bytes": 0} == {"handles": 0, "host_mirrors": 0, "host_mirror_bytes": 0, "onloaded_groups": 0,
                                         "registered_bytes": 0, "offload_patchers": 0, "diffusion_models": 0,
                                         "rss_bytes": 0}


def test_handles_live_exactly_as_long_as_their_models(comfy_server):
    name = comfy_server.models.unet_name
    first = live(comfy_server, loader_workflow(name, 71, prefetch=1), samples=["6", 0])
    assert first["handles"] == 1 and first["host_mirrors"] > 0
    groups = first["host_mirrors"]

    # Settings changed on the loader: the first model drops out of ComfyUI's cache.
    changed = live(comfy_server, loader_workflow(name, 71, prefetch=2), samples=["6", 0])
    assert (changed["handles"], changed["host_mirrors"]) == (1, groups)

    # The loader swapped for the node.
    swapped = live(comfy_server, node_workflow(name, 71), samples=["6", 0])
    assert (swapped["handles"], swapped["host_mirrors"]) == (1, groups)
    assert_nothing_left(comfy_server)

    # A report on a model that was never sampled fails; its model goes all the same.
    never_sampled = loader_workflow(name, 72)
    never_sampled["11"] = {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}
    never_sampled["6"]["inputs"]["model"] = ["11", 0]
    never_sampled["20"] = {"class_type": "GroupOffloadReport", "inputs": {"model": ["1", 0], "samples": ["6", 0]}}
    entry = comfy_server.wait(comfy_server.queue(never_sampled), check=False)
    assert entry["status"]["status_str"] == "error"
    assert_nothing_left(comfy_server)


def test_a_dropped_offloaded_clone_leaves_no_handle_on_its_plain_parent(comfy_server):
    name = comfy_server.models.unet_name
    entry, offloaded = run_counted(comfy_server, node_workflow(name, 73), samples=["6", 0])
    assert offloaded["handles"] == 1
    # Same plain loader (cached), the node gone: its clone is collected while the model lives on.
    plain_model_only = {"1": txt2img_workflow(name)["1"]}
    parent = live(comfy_server, plain_model_only, model=["1", 0])
    assert (parent["diffusion_models"], parent["offload_patchers"]) == (1, 0)
    assert (parent["handles"], parent["host_mirrors"]) == (0, 0), "no device copies left to a plain patcher"
    plain = comfy_server.run(txt2img_workflow(name, seed=73, filename_prefix="lifetimes_plain"))
    assert np.array_equal(_pixels(comfy_server, plain), _pixels(comfy_server, entry)), "the plain parent computes as before"
    assert_nothing_left(comfy_server)


def test_unload_gives_the_device_memory_back_and_free_releases_everything(comfy_server):
    """Unloading (ComfyUI making room, or POST /free with unload_models) frees the device copies at once
    and keeps the packed, pinned host copy of a model that is still cached, so that loading it again
    costs only device copies (two models taking turns); POST /free with free_memory drops the cached
    model, and its handle, host copies and pins go with it at once."""
    name = comfy_server.models.unet_name
    workflow = node_workflow(name, 74)
    sampled = live(comfy_server, workflow, samples=["6", 0])
    assert sampled["handles"] == 1 and sampled["onloaded_groups"] > 0 and sampled["registered_bytes"] > 0
    offloaded_model_only = {"1": workflow["1"], "10": workflow["10"]}

    assert comfy_server.post("/free", {"unload_models": True})[0] == 200
    # The flags are handled between prompts: poll, with no sampling run in between.
    unloaded = _poll(lambda: live(comfy_server, offloaded_model_only, model=["10", 0]),
                     done=lambda counts: counts["onloaded_groups"] == 0)
    assert (unloaded["handles"], unloaded["onloaded_groups"]) == (1, 0)
    assert unloaded["registered_bytes"] == sampled["registered_bytes"], "the pins stay with the cached model"

    assert comfy_server.post("/free", {"unload_models": True, "free_memory": True})[0] == 200
    freed = _poll(lambda: live(comfy_server, offloaded_model_only, model=["10", 0]),
                  done=lambda counts: counts["handles"] == 0)
    assert (freed["handles"], freed["host_mirrors"], freed["registered_bytes"]) == (0, 0, 0)
    assert freed["offload_patchers"] == 1, "the offloaded model itself is made again"
    assert_nothing_left(comfy_server)


def _poll(count, done, attempts: int = 20) -> dict:
    for _ in range(attempts):
        counts = count()
        if done(counts):
            break
        time.sleep(0.1)
    return counts


def _pixels(server, entry: dict) -> np.ndarray:
    (path,) = server.output_images(entry)
    return np.asarray(Image.open(path))
