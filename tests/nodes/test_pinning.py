"""Pinning through ComfyUI's own pin_memory (under a CUDA-runtime stand-in), its accounting, and the
handle's life across unloads: two offloaded models taking turns, another device, the VRAM flags."""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from testbed import fixture_models
from testbed import live_server
from testbed.fake_cudart import give_device_memory
from testbed.run_nodes import make_test_conditioning, run_node, run_txt2img
from testbed.node_runs import offload_handle, load_offloaded, load_plain, offload, raw_block_bytes

SECOND_MODEL = "tiny_qwen_image_4_blocks_second.safetensors"


def pins(handle) -> list[int]:
    """Sizes of the mirrors the handle holds pinned, in group order."""
    return [g.nbytes for g in handle.groups if g.mirror.pinned]


def streamed(handle) -> list[int]:
    return [g.nbytes for g in handle.groups if not g.resident]


# --- the handle's pinning policy, on its own ------------------------------------------------

class RecordingPinner:
    """A Pinner that refuses the calls whose (1-based) numbers are given."""

    def __init__(self, refuse_calls: set[int]) -> None:
        self.refuse_calls, self.calls, self.pinned = refuse_calls, 0, set()

    def pin(self, buffer: torch.Tensor) -> bool:
        self.calls += 1
        if self.calls in self.refuse_calls:
            return False
        self.pinned.add(buffer.data_ptr())
        return True

    def unpin(self, buffer: torch.Tensor) -> None:
        self.pinned.remove(buffer.data_ptr())


def test_the_handle_pins_streamed_groups_past_a_refusal_and_unpins_resident_ones():
    from offload_core import apply_group_offload

    blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
    pinner = RecordingPinner(refuse_calls={1})
    handle = apply_group_offload(blocks, list(blocks), "cpu", pinner=pinner)  # every group streams
    assert pinner.calls == 4 and len(pinner.pinned) == 3, "the first refusal stops nothing"
    group = handle.groups[0].nbytes
    assert handle.stats()["pinned_bytes"] == 3 * group
    handle.set_resident_bytes(group)  # one group resident: its mirror is not needed pinned
    assert sum(g.resident for g in handle.groups) == 1 and not handle.groups[1].resident  # group 1 was refused
    assert pinner.pinned == {g.mirror.buffer.data_ptr() for g in handle.groups if not g.resident}
    assert pinner.calls == 5, "the refused group, still streamed, is tried again"
    assert handle.unpin() == 3 * group and not pinner.pinned
    handle.remove()


# --- pinning under each residency mode ----------------------------------------------------------

@pytest.mark.parametrize("options, streamed_groups", [
    ({"residency": "stream_all"}, 4),
    ({"residency": "budget", "resident_gb": 0.0006}, 3),  # one of the four 0.6 MB groups resident
    ({"residency": "auto"}, 0),  # ComfyUI on the CPU has room for everything
])
@pytest.mark.parametrize("via", ["node", "loader"])
def test_the_streamed_groups_are_pinned_through_comfyui(models, fake_cudart, via, options, streamed_groups):
    import comfy.model_management as mm

    expected = run_txt2img(load_plain(), seed=11).latent
    if via == "node":
        model = offload(load_plain(), **options)
    else:
        model = load_offloaded(**options)
    assert torch.equal(run_txt2img(model, seed=11).latent, expected)
    handle = offload_handle(model)
    stats = handle.stats()
    assert len(streamed(handle)) == streamed_groups
    assert pins(handle) == streamed(handle), "exactly the streamed groups are pinned"
    assert sorted(fake_cudart.registered.values()) == sorted(streamed(handle)), "each mirror registered in place, at its size"
    assert stats["pinned_bytes"] == fake_cudart.registered_bytes == mm.TOTAL_PINNED_MEMORY == model.pinned_memory_size()
    assert {ptr for ptr in fake_cudart.registered} == {g.mirror.buffer.data_ptr() for g in handle.groups if g.mirror.pinned}


def test_a_second_run_pins_nothing_again(models, fake_cudart):
    model = offload(load_plain(), residency="stream_all")
    run_txt2img(model, seed=12)
    calls = len(fake_cudart.calls)
    run_txt2img(model, seed=13)
    assert len(fake_cudart.calls) == calls


def test_a_refused_pin_does_not_stop_the_others_and_is_reported(models, monkeypatch, caplog):
    import comfy.model_management as mm
    from testbed.fake_cudart import install

    expected = run_txt2img(load_plain(), seed=14).latent
    probe = offload(load_plain(), residency="stream_all")
    run_txt2img(probe, seed=14)
    group_bytes = offload_handle(probe).groups[0].nbytes
    limit = int(2.5 * group_bytes)  # 0.3.75 refuses past its limit; newest lets the driver refuse
    fake = install(monkeypatch.setattr, comfy_pin_limit=limit, driver_limit=limit)
    # Every group packed (auto would pack only what the limit can pin and leave the rest in place, unpinned).
    model = offload(load_plain(), residency="stream_all", host_memory="budget", host_gb=1024.0)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(run_txt2img(model, seed=14).latent, expected)
    handle = offload_handle(model)
    assert pins(handle) == [group_bytes] * 2 and fake.registered_bytes == 2 * group_bytes
    assert handle.stats()["pinned_bytes"] == 2 * group_bytes
    warning = next(r.getMessage() for r in caplog.records if "pinned-memory limit" in r.getMessage())
    assert "2 of 4 streamed groups are pinned" in warning and f"limit is {limit / 1e6:.1f} MB" in warning
    assert "fp8" in warning
    assert mm.TOTAL_PINNED_MEMORY == 2 * group_bytes


def test_the_pack_keeps_comfyuis_pinned_limit_itself(models, monkeypatch):
    """Newest ComfyUI's pin_memory registers past its limit; no driver limit here, so only the pack holds it."""
    import comfy.model_management as mm
    from testbed.fake_cudart import install

    expected = run_txt2img(load_plain(), seed=15).latent
    group_bytes = raw_block_bytes(load_plain()) // 4
    limit = int(2.5 * group_bytes)
    fake = install(monkeypatch.setattr, comfy_pin_limit=limit)
    model = offload(load_plain(), residency="stream_all")
    assert torch.equal(run_txt2img(model, seed=15).latent, expected)
    assert len(pins(offload_handle(model))) == 2 and fake.registered_bytes == mm.TOTAL_PINNED_MEMORY <= limit


def test_past_the_limit_the_least_recently_run_model_gives_its_pins_first(models, monkeypatch):
    """Two offloaded models taking turns (Wan 2.2's experts) within a limit that holds one and a group."""
    import comfy.model_management as mm
    from testbed.fake_cudart import install

    expected = run_txt2img(load_plain(), seed=16).latent
    first, second = (offload(load_plain(), residency="stream_all") for _ in range(2))
    limit = int(5.5 * raw_block_bytes(load_plain()) // 4)
    fake = install(monkeypatch.setattr, comfy_pin_limit=limit)
    for model, other in ((first, second), (second, first), (first, second)):
        assert torch.equal(run_txt2img(model, seed=16).latent, expected)
        assert len(pins(offload_handle(model))) == 4, "the model that runs gets every streamed group pinned"
        assert offload_handle(other) is None or len(pins(offload_handle(other))) == 1, "the other keeps only what still fits"
        assert fake.registered_bytes == mm.TOTAL_PINNED_MEMORY <= limit


# --- what releases the pins -----------------------------------------------------------------

def test_unloading_keeps_the_pins_and_gives_the_device_memory_back(models, fake_cudart):
    import comfy.model_management as mm

    model = offload(load_plain(), residency="stream_all")
    expected = run_txt2img(model, seed=15).latent
    handle = offload_handle(model)
    buffers = [g.mirror.buffer.data_ptr() for g in handle.groups]
    mm.unload_all_models()
    assert offload_handle(model) is handle and not any(g.onloaded for g in handle.groups)
    assert fake_cudart.registered_bytes == sum(streamed(handle)), "pins kept: loading again costs only device copies"
    registrations = len(fake_cudart.sizes("register"))
    assert torch.equal(run_txt2img(model, seed=15).latent, expected)
    assert len(fake_cudart.sizes("register")) == registrations and not fake_cudart.sizes("unregister")
    assert [g.mirror.buffer.data_ptr() for g in offload_handle(model).groups] == buffers


def test_releasing_ram_unpins_and_the_next_load_pins_again(models, fake_cudart):
    import comfy.model_management as mm

    model = offload(load_plain(), residency="stream_all")
    run_txt2img(model, seed=16)
    pinned = fake_cudart.registered_bytes
    assert model.partially_unload_ram(1 << 40) == pinned > 0
    assert fake_cudart.registered_bytes == 0 == mm.TOTAL_PINNED_MEMORY == model.pinned_memory_size()
    mm.unload_all_models()
    run_txt2img(model, seed=16)
    assert fake_cudart.registered_bytes == pinned


def test_a_plain_patcher_taking_over_leaves_nothing_registered(models, fake_cudart):
    import comfy.model_management as mm

    plain = load_plain()
    offloaded = offload(plain, residency="stream_all")
    run_txt2img(offloaded, seed=17)
    assert fake_cudart.registered_bytes > 0
    run_txt2img(plain, seed=17)
    assert offload_handle(plain) is None
    assert fake_cudart.registered_bytes == 0 == mm.TOTAL_PINNED_MEMORY
    assert len(fake_cudart.sizes("register")) == len(fake_cudart.sizes("unregister")) == 4


def test_new_settings_repin_only_what_streams_then(models, fake_cudart):
    once = offload(load_plain(), residency="stream_all")
    run_txt2img(once, seed=18)
    twice = offload(once, residency="budget", resident_gb=0.0012, blocks_per_group=2)
    run_txt2img(twice, seed=18)
    assert sorted(fake_cudart.registered.values()) == sorted(streamed(offload_handle(twice))) == sorted(pins(offload_handle(twice)))


@pytest.mark.parametrize("via", ["node", "loader"])
def test_a_dropped_model_leaves_nothing_registered_without_a_garbage_collection(models, fake_cudart, via):
    """ComfyUI drops a model by dropping its last reference (its cache, POST /free): the handle and its pins
    go with it, not at a later garbage collection, whose time depends on allocation counts."""
    import comfy.model_management as mm

    model = offload(load_plain()) if via == "node" else load_offloaded()
    run_txt2img(model, seed=19)
    assert fake_cudart.registered_bytes > 0
    mm.unload_all_models()
    gc.collect()  # what sampling left in reference cycles of ComfyUI's own
    gc.disable()
    try:
        del model
        assert fake_cudart.registered_bytes == 0 == mm.TOTAL_PINNED_MEMORY
    finally:
        gc.enable()


# --- through the server: what POST /free, Unload models and new settings leave pinned --------

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
ONE_RESIDENT = OFFLOAD | {"residency": "budget", "resident_gb": 0.0006}  # one of the two 0.6 MB groups


def served_pins(server) -> int:
    """Bytes the server holds registered; its stand-in and ComfyUI's pinned total must agree."""
    pins = server.get("/group_offload_test/pins")
    assert pins["registered_bytes"] == pins["total_pinned"]
    return pins["registered_bytes"]


def offloaded_workflow(server, options: dict = OFFLOAD) -> dict:
    return live_server.txt2img_workflow(server.models.unet_name, model_patch=("GroupOffload", options))


def upstream(workflow: dict, node_id: str) -> dict:
    """``node_id`` and every node it takes an input from, directly or not."""
    nodes = {node_id: workflow[node_id]}
    for value in workflow[node_id]["inputs"].values():
        if isinstance(value, list):  # a link: [node id, output index]
            nodes |= upstream(workflow, value[0])
    return nodes


def settle(server, workflow: dict) -> None:
    """Return once the server has handled every POST /free sent before, and change nothing else.

    ComfyUI's worker reads the /free flags after each prompt and whenever its queue wakes it; the queue's
    wait does not look at them, so flags set after the worker's last read and before that wait (while it
    collects garbage after a prompt) wake nothing and stay unhandled until the next prompt, or for 1000 s
    (issue 24). The worker handles flags it has before it starts the next prompt: so two prompts follow,
    and the second has finished only once the flags were handled. They hold the sampler's model and all
    it comes from, so that ComfyUI's classic cache keeps what ``workflow`` made, and show that model as
    text: nothing sampled, nothing pinned.
    """
    model = workflow["6"]["inputs"]["model"]
    prompt = upstream(workflow, model[0]) | {"settle": {"class_type": "PreviewAny", "inputs": {"source": model}}}
    first = server.queue(prompt)
    server.run(prompt)
    server.wait(first)


def post_free(server, workflow: dict, **flags: bool) -> None:
    """POST /free with ``flags``, handled by the time this returns (see ``settle``)."""
    assert server.post("/free", flags)[0] == 200
    settle(server, workflow)


@pytest.fixture
def server(comfy_server):
    """The shared test server, with what other tests left there freed: nothing pinned."""
    post_free(comfy_server, offloaded_workflow(comfy_server), unload_models=True, free_memory=True)
    assert served_pins(comfy_server) == 0
    return comfy_server


def test_post_free_releases_the_pins_of_a_served_model(server):
    """The UI's "Free model and node cache": POST /free unloads every model and drops the cached outputs."""
    workflow = offloaded_workflow(server)
    server.run(workflow)
    assert served_pins(server) > 0
    post_free(server, workflow, unload_models=True, free_memory=True)
    assert served_pins(server) == 0


def test_a_post_free_the_queue_misses_is_handled_at_the_next_prompt(tmp_path):
    """Issue 24: a POST /free that lands while ComfyUI's worker collects garbage after a prompt wakes
    nothing: its flags wait in the queue, and the model stays cached with its pins (a loaded CI host met
    this once, and polled them for 60 s). The test server holds that collection until the POST lands, so
    it happens every time. The next prompt has the worker handle the flags: then the pins go."""
    env = {"GROUP_OFFLOAD_FAKE_CUDART": "1", "GROUP_OFFLOAD_HOLD_WORKER_GC": "1"}
    with live_server.ComfyServer(tmp_path, env=env, classic_cache=True) as server:
        workflow = offloaded_workflow(server)
        server.run(workflow)
        pinned = served_pins(server)
        assert server.post("/free", {"unload_models": True, "free_memory": True})[0] == 200
        assert served_pins(server) == pinned > 0, "reproduced: the flags wait in ComfyUI's queue, unhandled"
        settle(server, workflow)
        assert served_pins(server) == 0


def test_unload_models_alone_keeps_the_pins_of_a_cached_model(server):
    """The UI's "Unload models" (POST /free with unload_models) keeps the packed, pinned host copies of a
    model that is still cached, by design: loading it again then costs only device copies."""
    workflow = offloaded_workflow(server)
    server.run(workflow)
    pinned = served_pins(server)
    post_free(server, workflow, unload_models=True)
    assert served_pins(server) == pinned > 0


@pytest.mark.parametrize("node", ["GroupOffload", "GroupOffloadLoader"])
def test_new_settings_leave_only_the_new_plans_pins(server, node):
    """The node's settings changed: ComfyUI's classic cache drops the old output at the next prompt. On the
    node, the new clone drives the same handle, pinning one group fewer; on the loader, the old model goes
    with its pins, before the new one pins its own."""
    def workflow(options: dict) -> dict:
        if node == "GroupOffload":
            return offloaded_workflow(server, options)
        changed = live_server.txt2img_workflow(server.models.unet_name)
        changed["1"] = {"class_type": node, "inputs": {**changed["1"]["inputs"], **options}}
        return changed

    server.run(workflow(OFFLOAD))
    both_groups = served_pins(server)
    server.run(workflow(ONE_RESIDENT))
    assert served_pins(server) == both_groups // 2 > 0


# --- two offloaded models taking turns (Wan 2.2's experts) ----------------------------------

@pytest.fixture(scope="module")
def second_model(models):
    target = models.models_dir / "diffusion_models" / SECOND_MODEL
    if not target.exists():
        target.symlink_to(fixture_models.tiny_qwen_image_file(num_layers=4, seed=1))
    return SECOND_MODEL


def two_expert_run(high, low, steps: int = 4, switch=lambda: None) -> torch.Tensor:
    """Two KSamplerAdvanced splitting the steps, the way Wan 2.2 workflows run their experts;
    ``switch`` runs before each sampler (what a GPU's load_models_gpu does when the next needs the room)."""
    positive, negative = make_test_conditioning(1), make_test_conditioning(2)
    common = {"noise_seed": 21, "steps": steps, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
              "positive": positive, "negative": negative}
    with torch.inference_mode():
        (latent,) = run_node("EmptySD3LatentImage", width=64, height=64, batch_size=1).outputs
        switch()
        (latent,) = run_node("KSamplerAdvanced", model=high, add_noise="enable", latent_image=latent, start_at_step=0,
                             end_at_step=steps // 2, return_with_leftover_noise="enable", **common).outputs
        switch()
        (latent,) = run_node("KSamplerAdvanced", model=low, add_noise="disable", latent_image=latent,
                             start_at_step=steps // 2, end_at_step=steps, return_with_leftover_noise="disable",
                             **common).outputs
    return latent["samples"]


def unload_everything() -> None:
    import comfy.model_management as mm

    mm.free_memory(1e30, torch.device("cpu"))


def host_storage_bytes(*patchers) -> int:
    """Host memory the diffusion models' tensors occupy, each storage counted once."""
    storages = {}
    for patcher in patchers:
        for tensor in (*patcher.model.diffusion_model.parameters(), *patcher.model.diffusion_model.buffers()):
            storage = tensor.untyped_storage()
            if storage.device.type == "cpu":
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_two_offloaded_models_take_turns_with_device_copies_only(models, second_model, fake_cudart):
    high_plain, low_plain = load_plain(), run_node("UNETLoader", unet_name=second_model, weight_dtype="default").outputs[0]
    expected = two_expert_run(high_plain, low_plain)
    high = offload(load_plain(), residency="stream_all")
    low = offload(run_node("UNETLoader", unet_name=second_model, weight_dtype="default").outputs[0], residency="stream_all")
    assert torch.equal(two_expert_run(high, low, switch=unload_everything), expected)
    handles = offload_handle(high), offload_handle(low)
    buffers = [g.mirror.buffer.data_ptr() for h in handles for g in h.groups]
    registrations = len(fake_cudart.sizes("register"))
    assert registrations == 8 and fake_cudart.registered_bytes == sum(h.stats()["host_bytes"] for h in handles)
    host_one, host_two = host_storage_bytes(high), host_storage_bytes(high, low)
    for _ in range(2):  # two more prompts: every sampler finds the other model unloaded
        assert torch.equal(two_expert_run(high, low, switch=unload_everything), expected)
    assert (offload_handle(high), offload_handle(low)) == handles, "no handle rebuilt"
    assert [g.mirror.buffer.data_ptr() for h in handles for g in h.groups] == buffers, "nothing re-packed"
    assert len(fake_cudart.sizes("register")) == registrations and not fake_cudart.sizes("unregister"), "nothing re-pinned"
    assert host_storage_bytes(high, low) == host_two and host_storage_bytes(high) == host_one
    assert host_two == host_one + host_storage_bytes(low), "host memory holds each model once"


def test_past_the_limit_the_running_model_takes_the_pins_of_the_unloaded_one(models, second_model, monkeypatch):
    import comfy.model_management as mm
    from testbed.fake_cudart import install

    high_plain, low_plain = load_plain(), run_node("UNETLoader", unet_name=second_model, weight_dtype="default").outputs[0]
    expected = two_expert_run(high_plain, low_plain)
    group = offload(load_plain()).handle(torch.device("cpu")).groups[0].nbytes
    limit = int(5.5 * group)  # room for one model's four groups, not for both
    fake = install(monkeypatch.setattr, comfy_pin_limit=limit, driver_limit=limit)
    high = offload(load_plain(), residency="stream_all")
    low = offload(run_node("UNETLoader", unet_name=second_model, weight_dtype="default").outputs[0], residency="stream_all")
    pinned_groups = []  # (high's, low's) at each switch, before the next sampler loads its model

    def switch() -> None:
        unload_everything()
        pinned_groups.append(tuple(len(pins(offload_handle(m))) if offload_handle(m) else 0 for m in (high, low)))

    for _ in range(2):
        assert torch.equal(two_expert_run(high, low, switch=switch), expected)
        assert fake.registered_bytes == mm.TOTAL_PINNED_MEMORY <= limit
    # Each model, while it ran, held all its pins; the other gave up only what did not fit beside them.
    assert pinned_groups == [(0, 0), (4, 0), (1, 4), (4, 1)]
    assert len(pins(offload_handle(low))) == 4 and len(pins(offload_handle(high))) == 1


# --- another device, and the VRAM flags -----------------------------------------------------
# The meta device stands in for a GPU: ComfyUI's memory code runs as for one, with its free and
# total memory given (the CUDA runtime's figures), and nothing is computed on it.

GPU = torch.device("meta")


def test_loading_on_another_device_rebuilds_the_handle_on_the_same_host_buffers(models, monkeypatch):
    give_device_memory(monkeypatch.setattr, free=1 << 40)
    model = offload(load_plain(), residency="stream_all")
    model.load(torch.device("cpu"), lowvram_model_memory=1 << 40, full_load=True)
    first = offload_handle(model)
    buffers = [g.mirror.buffer.data_ptr() for g in first.groups]
    model.load(GPU, lowvram_model_memory=1 << 40, full_load=True)  # as cuda:1 after cuda:0
    second = offload_handle(model)
    assert second is not first and second.config.onload_device == GPU
    assert [g.mirror.buffer.data_ptr() for g in second.groups] == buffers, "the packed host buffers are adopted"
    second.release_device_memory()


# --- the VRAM flags -------------------------------------------------------------------------

FLAGS = {  # flag -> what it sets in comfy.model_management
    "normal": {},
    "--lowvram": {"vram_state": "LOW_VRAM", "lowvram_available": True},
    "--novram": {"vram_state": "NO_VRAM"},
    "--highvram": {"vram_state": "HIGH_VRAM"},
    "--gpu-only": {"vram_state": "HIGH_VRAM"},
    "--reserve-vram 2": {"EXTRA_RESERVED_VRAM": 2 * 2**30},
}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("free_groups", [1.5, 3.5])
def test_auto_stays_within_the_really_free_memory_under_each_vram_flag(models, monkeypatch, flag, free_groups):
    """ComfyUI's real load_models_gpu decides the budget under each flag; the resident groups must
    fit what is really free, and the blocks never land on the device whole."""
    import comfy.model_management as mm

    plain = load_plain()
    if FLAGS[flag].get("vram_state") == "HIGH_VRAM":
        plain.offload_device = GPU  # ComfyUI's unet_offload_device() under these flags
    model = offload(plain, residency="auto", prefetch=1)
    model.load_device = GPU
    for name, value in FLAGS[flag].items():
        monkeypatch.setattr(mm, name, getattr(mm.VRAMState, value) if name == "vram_state" else value)
    give_device_memory(monkeypatch.setattr, free=0)
    group = model.handle(GPU).groups[0].nbytes
    other = mm.module_size(model.model) - raw_block_bytes(model)
    free = mm.minimum_inference_memory() + other + 2 * group + int(free_groups * group)  # beside the 2 slabs
    give_device_memory(monkeypatch.setattr, free)
    handle = model.handle(GPU)
    monkeypatch.setattr(handle, "onload_resident", lambda: None)  # a meta tensor cannot back a CPU Parameter
    try:
        mm.load_models_gpu([model])
        stats = handle.stats()
        assert stats["resident_groups"] == (0 if flag == "--novram" else int(free_groups))
        assert stats["resident_bytes"] + 2 * group <= free - mm.minimum_inference_memory() - other
        assert offload_handle(model) is handle
        assert all(g.mirror.buffer.device.type == "cpu" for g in handle.groups), "host mirrors stay on the CPU"
        assert all(p.device.type == "cpu" for p in model.model.diffusion_model.transformer_blocks.parameters()), \
            "ComfyUI's own load does not move the blocks"
        assert model.offload_device == torch.device("cpu")
    finally:  # its other weights are on the meta device now: forget it rather than unload it
        mm.current_loaded_models[:] = [m for m in mm.current_loaded_models if m.model is not model]


@pytest.mark.parametrize("flag", ["--highvram", "--gpu-only"])
def test_the_loader_builds_the_model_off_the_gpu_under_high_vram_flags(models, monkeypatch, flag):
    """ComfyUI's offload device is the GPU under these flags: the loader must not let ComfyUI move the
    freshly built model there whole (the meta device stands in for the GPU)."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.HIGH_VRAM)
    monkeypatch.setattr(mm, "get_torch_device", lambda: GPU)
    give_device_memory(monkeypatch.setattr, free=1 << 40)
    model = run_node("GroupOffloadLoader", unet_name=models.unet_name, weight_dtype="default",
                     blocks_per_group=1, prefetch=1, residency="stream_all", resident_gb=0.0).outputs[0]
    assert model.load_device == GPU and model.offload_device == torch.device("cpu")
    assert {p.device.type for p in model.model.parameters()} == {"cpu"}, "nothing of the model on the GPU yet"


def test_pins_are_counted_once(models, fake_cudart, monkeypatch):
    """Newest ComfyUI makes room for ``model_size()`` more pinned bytes at every load (0.3.75 only
    for device memory): the streamed groups, already pinned, must not be in it."""
    import comfy.model_management as mm

    group = offload(load_plain(), residency="auto").handle(torch.device("cpu")).groups[0].nbytes  # all resident
    model = offload(load_plain(), residency="auto", prefetch=1)
    model.load_device = GPU
    other = mm.module_size(model.model) - raw_block_bytes(model)
    give_device_memory(monkeypatch.setattr, free=0, total=mm.minimum_inference_memory() + other + 2 * group + int(1.5 * group))
    handle = model.handle(GPU)  # plans against the device's whole memory: one group resident, three streamed
    assert pins(handle) == streamed(handle) == [group] * 3
    assert model.pinned_memory_size() == 3 * group == fake_cudart.registered_bytes
    assert model.model_size() == other + group + 2 * group, "the rest, one resident group and two slabs"
    assert model.model_size() + model.pinned_memory_size() == other + handle.stats()["host_bytes"] + 2 * group
