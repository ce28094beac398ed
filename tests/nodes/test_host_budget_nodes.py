"""The host budget on the nodes (issue 23): the ``host_memory`` / ``host_gb`` inputs and their checks, the budget
they give a model about to be built (``auto`` from the RAM available and ComfyUI's pinned-memory limit, ``budget``
shared by every offloaded model), prompts saved before the inputs existed, and the check of the mapped files
before each run. What a budget saves in host memory is measured in test_host_budget.py."""
from __future__ import annotations

import gc
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from testbed import fixture_models
from testbed.live_server import ComfyServer, PromptRejected, txt2img_workflow
from testbed.pack_modules import pack_module
from testbed.run_nodes import node_output, run_txt2img
from testbed.node_runs import OFFLOAD_DEFAULTS, load_offloaded, load_plain, offload, offload_handle, te_names  # noqa: F401

GiB = 1024**3
HOST_INPUTS = {"host_memory": "auto", "host_gb": 0.0}
NODES = ["GroupOffload", "GroupOffloadLoader"]


def node_class(name: str):
    return pack_module("nodes.offload_nodes").NODE_CLASS_MAPPINGS[name]


# --- the inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("node", NODES)
def test_both_nodes_take_the_host_inputs_as_optional_ones_with_their_defaults(comfy, node):
    spec = node_class(node).INPUT_TYPES()
    assert set(HOST_INPUTS).isdisjoint(spec["required"])
    assert list(spec["optional"]) == list(HOST_INPUTS)
    assert {name: options[1]["default"] for name, options in spec["optional"].items()} == HOST_INPUTS
    assert spec["optional"]["host_memory"][0] == ["auto", "budget"]
    assert (spec["optional"]["host_gb"][1]["min"], spec["optional"]["host_gb"][1]["max"]) == (0.0, 4096.0)


@pytest.mark.parametrize("inputs, problem", [
    ({"host_memory": "sometimes"}, "host_memory must be one of auto, budget, got 'sometimes'"),
    ({"host_gb": -1.0}, "host_gb must be a finite number from 0 to 4096 (GB), got -1.0"),
    ({"host_gb": 4097.0}, "host_gb must be a finite number from 0 to 4096 (GB), got 4097.0"),
    ({"host_gb": math.nan}, "host_gb must be a finite number from 0 to 4096 (GB), got nan"),
    ({"host_gb": math.inf}, "host_gb must be a finite number from 0 to 4096 (GB), got inf"),
])
def test_out_of_range_host_settings_are_refused_naming_the_input(comfy, inputs, problem):
    with pytest.raises(ValueError) as refused:
        pack_module("nodes.settings").OffloadSettings(**inputs).validate()
    assert str(refused.value) == problem


def test_in_range_host_settings_pass(comfy):
    settings = pack_module("nodes.settings")
    for host_memory in ("auto", "budget"):
        for host_gb in (0.0, 0.5, 4096.0):
            settings.OffloadSettings(host_memory=host_memory, host_gb=host_gb).validate()
    assert settings.OffloadSettings(host_gb=1.5).host_bytes() == int(1.5 * GiB)


@pytest.mark.parametrize("node", NODES)
def test_input_validation_checks_host_gb_and_lets_older_prompts_and_links_through(comfy, node):
    validate = node_class(node).VALIDATE_INPUTS
    assert validate(resident_gb=0.0) is True  # a prompt saved before host_gb existed
    assert validate(resident_gb=0.0, host_gb=12.0) is True
    assert validate(resident_gb=0.0, host_gb=None) is True  # linked: checked when the node runs
    assert validate(resident_gb=0.0, host_gb=math.nan) == "host_gb must be a finite number from 0 to 4096 (GB), got nan"
    assert validate(resident_gb=-1.0, host_gb=1.0).startswith("resident_gb must be")


def test_a_bad_host_memory_fails_the_node(models):
    with pytest.raises(ValueError, match="host_memory must be one of auto, budget"):
        offload(load_plain(), host_memory="sometimes")


# --- prompts saved before the inputs ------------------------------------------------------------


@pytest.mark.parametrize("via", ["node", "loader"])
def test_a_prompt_without_the_host_inputs_packs_every_group_as_before(models, via):
    expected = run_txt2img(load_plain(), seed=21).latent
    model = offload(load_plain()) if via == "node" else load_offloaded()  # the four inputs of older prompts
    assert (model.offload_settings.host_memory, model.offload_settings.host_gb) == ("auto", 0.0)
    assert torch.equal(run_txt2img(model, seed=21).latent, expected)
    stats = offload_handle(model).stats()
    assert stats["packed_bytes"] == stats["host_bytes"] > 0 and stats["in_place_bytes"] == 0


def test_api_prompts_with_and_without_the_host_inputs_run_and_a_nan_host_gb_is_refused(comfy_server: ComfyServer):
    name = comfy_server.models.unet_name
    old = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
    for seed, options in ((91, old), (92, old | {"host_memory": "budget", "host_gb": 0.0})):
        entry = comfy_server.run(txt2img_workflow(name, seed=seed, model_patch=("GroupOffload", options)))
        assert comfy_server.output_images(entry)
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(txt2img_workflow(name, seed=93, model_patch=("GroupOffload", old | {"host_gb": math.nan})))
    errors = rejected.value.body["node_errors"]["10"]["errors"]
    assert {"type": "custom_validation_failed", "details": "host_gb - host_gb must be a finite number from 0 to 4096 "
            "(GB), got nan"}.items() <= next(e for e in errors if e["details"].startswith("host_gb")).items()


# --- the budget a model gets --------------------------------------------------------------------


@pytest.fixture
def machine(comfy, monkeypatch: pytest.MonkeyPatch):
    """``machine(total, available, max_pinned, pinned, containers)`` in GiB: what nodes.memory sees of RAM and pins,
    and the memory cgroups' limits (``hostlimits.CgroupLimit``; none by default)."""
    memory = pack_module("nodes.memory")

    def set_up(total: float, available: float, max_pinned: float = -1, pinned: float = 0,
               containers: tuple = ()) -> None:
        ram = SimpleNamespace(total=int(total * GiB), available=int(available * GiB))
        monkeypatch.setattr(memory, "psutil", SimpleNamespace(virtual_memory=lambda: ram))
        monkeypatch.setattr(memory, "cgroup_limits", lambda: containers)
        monkeypatch.setattr(memory.mm, "MAX_PINNED_MEMORY", max_pinned * GiB)
        monkeypatch.setattr(memory.mm, "TOTAL_PINNED_MEMORY", int(pinned * GiB))

    return set_up


@pytest.mark.parametrize("total, available, max_pinned, pinned, blocks, freed, expected", [
    (64, 40, -1, 0, 50, 0, 40 - 0.15 * 64),  # the headroom is 15 % of RAM...
    (16, 10, -1, 0, 50, 0, 10 - 4),  # ...and never less than 4 GiB
    (64, 40, -1, 0, 30, 0, None),  # the blocks fit: every group packed, as before host budgets
    (64, 40, -1, 0, 40 - 0.15 * 64, 0, None),
    (64, 20, -1, 0, 40, 40, None),  # the node's path: ComfyUI's own tensors go as their groups are packed
    (64, 20, -1, 0, 40, 10, 20 - 0.15 * 64 + 10),
    (64, 40, 30, 0, 50, 0, 30),  # no more than ComfyUI's pinned-memory limit...
    (64, 40, 30, 25, 50, 20, 30),  # ...whatever other models hold pinned: the model that runs takes their pins
    (32, 3, -1, 0, 50, 0, 0),  # less available than the headroom: nothing packed
    (32, 3, -1, 0, 0, 0, None),
])
def test_auto_budget_is_the_ram_available_less_a_headroom_within_the_pinned_limit(
        machine, total, available, max_pinned, pinned, blocks, freed, expected):
    memory, settings = pack_module("nodes.memory"), pack_module("nodes.settings")
    machine(total, available, max_pinned, pinned)
    budget = memory.host_budget(settings.OffloadSettings(), int(blocks * GiB), packed_elsewhere=7 * GiB,
                                freed_by_packing=int(freed * GiB))
    assert budget.bytes == (None if expected is None else pytest.approx(int(expected * GiB), abs=1))
    assert budget.bound_by == ("ComfyUI's pinned-memory limit" if max_pinned == 30 else "RAM available")


@pytest.mark.parametrize("host_memory, blocks, expected, taken", [
    ("auto", 50, 40 - 9.6 + 10, 10),  # the text encoders' packed copies count as room, all of them taken...
    ("auto", 35, None, 35 - 30.4),  # ...or what the blocks need past the room without them
    ("auto", 20, None, 0),  # the room alone holds the blocks: the text encoders keep theirs
    ("budget", 12, 10 - 12 + 10, 10),  # host_gb 10, 12 packed elsewhere (the text encoders' 10 among them): 2 short
    ("budget", 5, None, 5 + 2),  # already, so the text encoders give up 2 more than the blocks take
])
def test_the_text_encoders_packed_copies_are_the_first_room_a_diffusion_model_takes(machine, host_memory, blocks,
                                                                                    expected, taken):
    memory, settings = pack_module("nodes.memory"), pack_module("nodes.settings")
    machine(64, 40)
    chosen = settings.OffloadSettings(host_memory=host_memory, host_gb=10.0)
    budget = memory.host_budget(chosen, int(blocks * GiB), packed_elsewhere=12 * GiB, freed_by_packing=0,
                                givable=10 * GiB)
    assert budget.bytes == (None if expected is None else pytest.approx(int(expected * GiB), abs=1))
    assert budget.taken_from_text_encoders == pytest.approx(int(taken * GiB), abs=1)


@pytest.mark.parametrize("limit, usage, cache, expected, bound_by", [
    (16, 3, 2, 16 - 1 - 4 - 0, "cgroup"),  # the container's room less its headroom (4 GiB at least)...
    (64, 40, 0, 64 - 40 - 0.15 * 64, "cgroup"),  # ...and 15 % of its limit
    (64, 2, 0, 40 - 0.15 * 128, "RAM available"),  # the machine is tighter than the container
    (2, 0.5, 0, 0, "cgroup"),  # a container smaller than its headroom: nothing packed
])
def test_auto_budget_sees_a_containers_memory_limit(machine, limit, usage, cache, expected, bound_by):
    """A container's limit (its memory cgroup's) binds the budget where it leaves less than the machine's RAM; the
    page cache it charged counts as room (the kernel reclaims it first), and the budget names the limit."""
    memory, settings, hostlimits = (pack_module(name) for name in ("nodes.memory", "nodes.settings",
                                                                   "offload_core.hostlimits"))
    name = "cgroup v2 memory.max of /docker/abc"
    machine(128, 40, containers=[hostlimits.CgroupLimit(name, int(limit * GiB), int(usage * GiB), int(cache * GiB))])
    budget = memory.host_budget(settings.OffloadSettings(), 100 * GiB, packed_elsewhere=0, freed_by_packing=0)
    assert budget.bytes == pytest.approx(int(expected * GiB), abs=1)
    assert budget.bound_by == (name if bound_by == "cgroup" else bound_by)


def test_the_cgroup_limits_are_read_from_every_level_up_to_the_hierarchys_root(tmp_path):
    """v2 and v1, as a container mounts them (its own cgroup at the mount's root) and as a host does."""
    hostlimits = pack_module("offload_core.hostlimits")
    v2, v1 = tmp_path / "unified", tmp_path / "memory"
    for folder, files in ((v2 / "outer", {"memory.max": "4000", "memory.current": "3000",
                                          "memory.stat": "anon 2000\nactive_file 600\ninactive_file 400\n"}),
                          (v2 / "outer" / "inner", {"memory.max": "max", "memory.current": "10", "memory.stat": ""}),
                          (v1 / "box", {"memory.limit_in_bytes": "9000", "memory.usage_in_bytes": "5000",
                                        "memory.stat": "total_active_file 1000\ntotal_inactive_file 500\n"}),
                          (v1, {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "1",
                                "memory.stat": ""})):
        folder.mkdir(parents=True, exist_ok=True)
        for file, text in files.items():
            (folder / file).write_text(text)
    (tmp_path / "cgroup").write_text("0::/outer/inner\n4:memory:/box\n")
    (tmp_path / "mountinfo").write_text(f"41 31 0:38 / {v2} rw - cgroup2 cgroup2 rw\n"
                                        f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory\n")
    limits = hostlimits.cgroup_limits(tmp_path / "cgroup", tmp_path / "mountinfo")
    assert [(limit.name, limit.room) for limit in limits] == [
        ("cgroup v2 memory.max of /outer", 4000 - (3000 - 1000)),
        ("cgroup v1 memory.limit_in_bytes of /box", 9000 - (5000 - 1500)),
    ]
    assert hostlimits.cgroup_limits(tmp_path / "none", tmp_path / "mountinfo") == []


def test_packing_frees_the_blocks_anonymous_host_memory_not_their_file_pages(comfy, tmp_path):
    memory, offload_core = pack_module("nodes.memory"), pack_module("offload_core")
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(4096 * 4))
    mapped = offload_core.map_file(path).view(torch.float32)  # 4 pages of a file: its page cache, not RSS
    block = torch.nn.Linear(64, 64)  # 16 KiB + 256 B of anonymous memory
    block.register_buffer("in_file", mapped[:1024])
    block.register_buffer("placeholder", torch.empty((), dtype=torch.float32).expand(4096))  # one element stored
    block.register_buffer("alias", block.weight.data[0])  # the weight's storage, counted once
    assert memory.anonymous_host_bytes([block]) == (64 * 64 + 64 + 1) * 4
    assert memory.anonymous_host_bytes([block.to("meta")]) == 0


@pytest.mark.parametrize("host_gb, blocks, elsewhere, expected", [
    (2, 3, 0.5, 1.5),  # host_gb less what the other models hold packed
    (2, 3, 3, 0),
    (0, 3, 0, 0),  # nothing packed: every group in place
    (2, 1, 0.5, None),  # the blocks fit what is left
])
def test_an_explicit_budget_is_host_gb_less_what_the_other_models_packed(machine, host_gb, blocks, elsewhere, expected):
    memory, settings = pack_module("nodes.memory"), pack_module("nodes.settings")
    machine(total=1, available=0)  # the RAM, and what packing frees, do not matter to an explicit budget
    chosen = settings.OffloadSettings(host_memory="budget", host_gb=host_gb)
    budget = memory.host_budget(chosen, int(blocks * GiB), packed_elsewhere=int(elsewhere * GiB),
                                freed_by_packing=int(blocks * GiB))
    assert (budget.bytes, budget.bound_by) == (None if expected is None else int(expected * GiB), "host_gb")


def test_two_models_share_one_explicit_budget(models):
    """The first model takes what it needs of host_gb, the second what is left; once the first is gone, a
    third has the whole budget again. Every one computes exactly as the plain model."""
    expected = run_txt2img(load_plain(), seed=22).latent
    gc.collect()  # models earlier tests left to the garbage collector no longer count
    elsewhere = pack_module("nodes.handles").packed_host_bytes()
    first = offload(load_plain(), host_memory="budget", host_gb=0)  # only to measure the blocks
    run_txt2img(first, seed=22)
    block_bytes = offload_handle(first).stats()["host_bytes"]
    host_gb = (elsewhere + 1.5 * block_bytes) / GiB
    del first
    gc.collect()

    first, second = (offload(load_plain(), host_memory="budget", host_gb=host_gb) for _ in range(2))
    assert torch.equal(run_txt2img(first, seed=22).latent, expected)
    assert torch.equal(run_txt2img(second, seed=22).latent, expected)
    first_stats, second_stats = offload_handle(first).stats(), offload_handle(second).stats()
    assert first_stats["packed_bytes"] == first_stats["host_bytes"] == block_bytes
    assert 0 < second_stats["packed_bytes"] <= 0.5 * block_bytes
    assert second_stats["in_place_bytes"] == block_bytes - second_stats["packed_bytes"]
    assert second_stats["gathered_bytes"] > 0, "the groups left in place were gathered for each copy"

    del first
    gc.collect()
    third = offload(load_plain(), host_memory="budget", host_gb=host_gb)
    assert torch.equal(run_txt2img(third, seed=22).latent, expected)
    assert offload_handle(third).stats()["in_place_bytes"] == 0


def test_a_changed_host_budget_rebuilds_the_handle(models):
    plain = load_plain()
    packed = offload(plain, host_memory="budget", host_gb=4096.0)
    run_txt2img(packed, seed=23)
    assert offload_handle(packed).stats()["in_place_bytes"] == 0
    in_place = offload(plain, host_memory="budget", host_gb=0.0)
    run_txt2img(in_place, seed=23)
    stats = offload_handle(in_place).stats()
    assert stats["packed_bytes"] == 0 and stats["in_place_bytes"] == stats["host_bytes"]


# --- the files groups left in place read from ----------------------------------------------------


def test_a_changed_source_fails_the_run_before_anything_is_read_and_the_model_runs_once_restored(models, monkeypatch):
    offload_core = pack_module("offload_core")
    expected = run_txt2img(load_plain(), seed=24).latent
    model = offload(load_plain())  # the hook is the patcher's whatever the layout; the real file: the next test
    run_txt2img(model, seed=24)
    handle = offload_handle(model)

    def changed() -> None:
        raise offload_core.SourceChangedError("model.safetensors changed on disk since the offloaded model mapped it")

    monkeypatch.setattr(handle, "check_sources", changed)
    copies = handle.stats()["copies_h2d"]
    with pytest.raises(offload_core.SourceChangedError, match="changed on disk"):
        run_txt2img(model, seed=24)
    assert handle.stats()["copies_h2d"] == copies, "no group was read"
    monkeypatch.undo()  # the file restored
    assert torch.equal(run_txt2img(model, seed=24).latent, expected)



def test_a_model_file_changed_on_disk_is_a_node_error_and_the_server_runs_on(comfy_server: ComfyServer):
    """Through the loader with nothing packed, every group streams from the file's pages (float32, the dtype
    ComfyUI computes in on the CPU, so that the blocks are the file's bytes): a truncated file fails the next
    run with the core's message, before a page past its end is read (that would kill the server); the model stays
    refused once the file is whole again (its bytes are not compared), and runs once loaded again."""
    name = "host_budget_changing.safetensors"
    path = comfy_server.models.models_dir / "diffusion_models" / name
    shutil.copyfile(fixture_models.tiny_qwen_image_file(dtype=torch.float32), path)
    original = path.read_bytes()

    def run(seed: int, check: bool = True, prefetch: int = OFFLOAD_DEFAULTS["prefetch"]) -> dict:
        prompt = txt2img_workflow(name, seed=seed)
        prompt["1"] = {"class_type": "GroupOffloadLoader", "inputs": {
            "unet_name": name, "weight_dtype": "default", **OFFLOAD_DEFAULTS, "prefetch": prefetch,
            "host_memory": "budget", "host_gb": 0.0}}
        prompt["20"] = {"class_type": "GroupOffloadReport", "inputs": {"model": ["1", 0], "samples": ["6", 0]}}
        return comfy_server.wait(comfy_server.queue(prompt), check=check)

    (stats,) = run(94)["outputs"]["20"]["group_offload"]
    # (but for the vectors the loader reads at once: on this tiny model, a few %)
    assert stats["packed_bytes"] == 0 and stats["file_backed_bytes"] >= 0.9 * stats["in_place_bytes"] > 0
    with open(path, "r+b") as file:
        file.truncate(len(original) // 2)
    entry = run(95, check=False)
    error = next(m[1] for m in entry["status"]["messages"] if m[0] == "execution_error")
    assert error["node_type"] == "KSampler" and error["exception_type"].endswith("SourceChangedError")
    assert error["exception_message"].startswith(f"{name} is now {len(original) // 2} bytes on disk")
    with open(path, "r+b") as file:
        file.write(original)
    error = next(m[1] for m in run(96, check=False)["status"]["messages"] if m[0] == "execution_error")
    assert error["exception_message"].startswith(f"{name} was written to since the offloaded model mapped it")
    assert comfy_server.output_images(run(97, prefetch=0))  # a changed loader input: loaded again


def test_a_diffusion_model_takes_the_text_encoders_packed_copies_first_and_both_compute_as_before(models, te_names):
    """Load CLIP (Group Offload) packs the text encoder's layers; a diffusion model built afterwards under one shared
    budget that leaves it nothing else takes the text encoder's packed copies: those layers stream from the text
    encoder's file from then on, the readout says why, and the conditioning and the latent stay ComfyUI's."""
    text_encoders = pytest.importorskip("testbed.text_encoders")
    family = text_encoders.TEXT_ENCODER_FAMILIES["qwen_image"]
    state_of = pack_module("nodes.model_state").state_of
    expected_cond = text_encoders.encode_text(node_output(family.loader, **family.inputs(te_names)), "a red fox")
    expected_latent = run_txt2img(load_plain(), seed=24).latent
    probe = offload(load_plain(), host_memory="budget", host_gb=0)  # only to measure the blocks
    run_txt2img(probe, seed=24)
    block_bytes = offload_handle(probe).stats()["host_bytes"]
    del probe
    gc.collect()

    elsewhere = pack_module("nodes.handles").packed_host_bytes()
    clip = node_output("GroupOffloadCLIPLoader", clip_name=te_names[family.encoders[0]], type=family.type,
                       **OFFLOAD_DEFAULTS, host_memory="budget", host_gb=4096.0)
    text_encoder = state_of(clip.patcher.model).handle()
    te_packed = text_encoder.stats()["packed_bytes"]
    assert te_packed > 0 and 0.99 * te_packed < text_encoder.returnable_bytes() <= te_packed  # (but the layers' norms)
    host_gb = (elsewhere + te_packed) / GiB  # all of it spent already: the text encoder's copies are the only room
    model = offload(load_plain(), host_memory="budget", host_gb=host_gb)
    assert torch.equal(run_txt2img(model, seed=24).latent, expected_latent)

    dit_packed = offload_handle(model).stats()["packed_bytes"]
    te_stats = text_encoder.stats()
    assert 0 < dit_packed <= min(block_bytes, te_packed)
    assert te_stats["packed_bytes"] + dit_packed <= te_packed, "the shared budget holds"
    assert te_stats["in_place_bytes"] > 0  # the file's pages, but the layers' norms (ComfyUI read them at the load)
    assert te_stats["file_backed_bytes"] > 0.99 * te_stats["in_place_bytes"]
    text_encoder.reset_stats()
    cond, _ = text_encoders.encode_text(clip, "a red fox")
    assert torch.equal(cond, expected_cond[0])
    assert text_encoder.stats()["gathered_bytes"] > 0, "the layers given up stream from the file"
    last = pack_module("nodes.telemetry").last_run(clip.patcher.model)
    assert last["host_limit"] == pack_module("nodes.memory").GIVEN_TO_THE_DIFFUSION_MODEL
    dit_limit = pack_module("nodes.telemetry").last_run(model.model)["host_limit"]
    assert dit_limit.startswith("host_gb, ") and dit_limit.endswith(" of it the text encoder's")
    assert last["in_place_bytes"] == te_stats["in_place_bytes"]


def test_a_text_encoder_built_after_the_diffusion_model_takes_only_what_is_left(models, te_names):
    """The diffusion model first: a text encoder built later under the same budget packs what the diffusion model
    left, and takes nothing from it."""
    text_encoders = pytest.importorskip("testbed.text_encoders")
    family = text_encoders.TEXT_ENCODER_FAMILIES["qwen_image"]
    gc.collect()
    elsewhere = pack_module("nodes.handles").packed_host_bytes()
    probe = offload(load_plain(), host_memory="budget", host_gb=0)  # only to measure the blocks
    run_txt2img(probe, seed=24)
    block_bytes = offload_handle(probe).stats()["host_bytes"]
    del probe
    gc.collect()
    host_gb = (elsewhere + block_bytes) / GiB
    model = offload(load_plain(), host_memory="budget", host_gb=host_gb)
    run_txt2img(model, seed=25)
    clip = node_output("GroupOffloadCLIPLoader", clip_name=te_names[family.encoders[0]], type=family.type,
                       **OFFLOAD_DEFAULTS, host_memory="budget", host_gb=host_gb)
    text_encoders.encode_text(clip, "a red fox")
    assert offload_handle(model).stats()["packed_bytes"] == block_bytes
    te_stats = pack_module("nodes.model_state").state_of(clip.patcher.model).handle().stats()
    assert te_stats["packed_bytes"] == 0 and te_stats["in_place_bytes"] > 0
