"""The nodes on real ComfyUI, in-process: exact latents, the report, LoRA, fp8, unloading, accounting."""
from __future__ import annotations

import pytest
import torch

from testbed.run_nodes import run_node, run_txt2img
from testbed.pack_modules import pack_module
from testbed.core_faults import plannings
from testbed.node_runs import load_offloaded, load_plain, offload, offload_handle, raw_block_bytes, with_lora


SETTINGS = [
    {"prefetch": 0},
    {"prefetch": 1},
    {"prefetch": 2},
    {"blocks_per_group": 2},
    {"blocks_per_group": 3, "prefetch": 0},
    {"residency": "budget", "resident_gb": 0.0003},  # about one of the four ~0.2 MB groups
    {"residency": "auto"},
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("via", ["node", "loader"])
def test_latent_is_bit_identical(models, via, options):
    expected = run_txt2img(load_plain(), seed=7, steps=3).latent
    model = offload(load_plain(), **options) if via == "node" else load_offloaded(**options)
    for _ in range(2):  # a second run reuses the loaded handle
        assert torch.equal(run_txt2img(model, seed=7, steps=3).latent, expected)
    stats = offload_handle(model).stats()
    streamed = stats["groups"] - stats["resident_groups"]
    assert stats["bytes_d2h"] == 0
    assert (stats["bytes_h2d"] > 0) == (streamed > 0), "resident groups are copied once, at load"
    if options.get("residency") == "auto":
        assert streamed == 0, "ComfyUI on the CPU has room for everything"


def test_report_counts_one_copy_per_streamed_group(models):
    model = offload(load_plain(), prefetch=1)
    steps = 3  # equal token counts: ComfyUI batches cond and uncond, one pass per step
    first = run_txt2img(model, seed=1, steps=steps)
    report = run_node("GroupOffloadReport", model=model, samples={"samples": first.latent})
    stats = report.ui["group_offload"][0]
    assert report.outputs[0]["samples"] is first.latent
    assert stats["groups"] == 4 and stats["resident_groups"] == 0 and stats["bytes_d2h"] == 0
    # First run: the first pass learns the order (4 synchronous onloads); the last group then
    # prefetches the first one for the next pass, so one copy more than passes x groups.
    assert (stats["copies_h2d"], stats["sync_onloads"]) == (steps * 4 + 1, 4)
    run_txt2img(model, seed=2, steps=steps)
    stats = run_node("GroupOffloadReport", model=model, samples={"samples": first.latent}).ui["group_offload"][0]
    assert stats["bytes_h2d"] == steps * stats["streamed_bytes_per_pass"]
    assert (stats["copies_h2d"], stats["sync_onloads"], stats["steps"]) == (steps * 4, 0, steps)


def test_report_rejects_a_plain_model(models):
    with pytest.raises(ValueError, match="needs a model from Group Offload"):
        run_node("GroupOffloadReport", model=load_plain(), samples={"samples": torch.zeros(1)})


@pytest.mark.parametrize("order", ["lora_then_offload", "offload_then_lora"])
def test_lora_gives_the_same_latent(models, order):
    expected = run_txt2img(with_lora(load_plain(), 0.8), seed=3).latent
    assert not torch.equal(expected, run_txt2img(load_plain(), seed=3).latent), "the LoRA must change the result"
    if order == "lora_then_offload":
        model = offload(with_lora(load_plain(), 0.8))
    else:
        model = with_lora(offload(load_plain()), 0.8)
    assert torch.equal(run_txt2img(model, seed=3).latent, expected)


def test_lora_strength_change_reuses_the_pristine_mirrors(models):
    offloaded = offload(load_plain())
    run_txt2img(offloaded, seed=4)
    mirrors = [(g.mirror.buffer.data_ptr(), g.mirror.buffer.clone()) for g in offload_handle(offloaded).groups]
    for strength in (0.8, 0.3):
        expected = run_txt2img(with_lora(load_plain(), strength), seed=4).latent
        assert torch.equal(run_txt2img(with_lora(offloaded, strength), seed=4).latent, expected)
        groups = offload_handle(offloaded).groups
        assert [g.mirror.buffer.data_ptr() for g in groups] == [p for p, _ in mirrors], "no reload, no repack"
        assert all(torch.equal(g.mirror.buffer, before) for g, (_, before) in zip(groups, mirrors))


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_fp8_mirrors_move_half_the_bytes(models, weight_dtype):
    expected = run_txt2img(load_plain(weight_dtype), seed=5).latent
    model = load_offloaded(weight_dtype)
    assert torch.equal(run_txt2img(model, seed=5).latent, expected)
    bf16 = load_offloaded()
    fp8_bytes, bf16_bytes = offload_handle(model).stats()["host_bytes"], offload_handle(bf16).stats()["host_bytes"]
    assert fp8_bytes < 0.6 * bf16_bytes
    assert {s.dtype for g in offload_handle(model).groups for s in g.mirror.segments} & {torch.float8_e4m3fn, torch.float8_e5m2}


def test_unloading_keeps_the_handle_without_device_memory_and_host_memory_flat(models):
    import comfy.model_management as mm

    model = offload(load_plain(), residency="budget", resident_gb=0.0006)  # one group resident
    expected = run_txt2img(model, seed=6).latent
    handle = offload_handle(model)
    host_bytes = handle.stats()["host_bytes"]
    blocks = model.model.diffusion_model.transformer_blocks
    for _ in range(3):
        mm.unload_all_models()
        assert offload_handle(model) is handle, "the packed (and pinned) mirrors stay for the next load"
        assert not any(g.onloaded for g in handle.groups) and model.loaded_size() == 0
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in blocks.parameters()}
        assert sum(storages.values()) == host_bytes, "weights stay packed, once, in host memory"
        assert torch.equal(run_txt2img(model, seed=6).latent, expected)


def test_plain_clone_after_offloaded_one_is_not_half_offloaded(models):
    plain = load_plain()
    expected = run_txt2img(plain, seed=8).latent
    offloaded = offload(plain)
    assert torch.equal(run_txt2img(offloaded, seed=8).latent, expected)
    assert torch.equal(run_txt2img(plain, seed=8).latent, expected)
    assert offload_handle(plain) is None and offload_handle(offloaded) is None


def test_applying_twice_reconfigures(models):
    once = offload(load_plain(), prefetch=1)
    expected = run_txt2img(once, seed=9).latent
    twice = offload(once, prefetch=2, blocks_per_group=2)
    assert torch.equal(run_txt2img(twice, seed=9).latent, expected)
    handle = offload_handle(twice)
    assert (handle.config.prefetch, len(handle.groups)) == (2, 2)


@pytest.mark.parametrize("field, value", [("residency", "sometimes"), ("blocks_per_group", 0),
                                          ("prefetch", -1), ("resident_gb", -1.0)])
def test_bad_settings_are_refused(models, field, value):
    with pytest.raises(ValueError, match=field):
        offload(load_plain(), **{field: value})


# --- memory accounting with given figures ----------------------------------------------------

MB = 2**20


@pytest.mark.parametrize("residency, gb, budget, full_load, free, expected", [
    ("stream_all", 0.0, 10_000 * MB, False, 10_000 * MB, 0),
    ("budget", 1.5, 0, False, 0, int(1.5 * 1024**3)),
    ("auto", 0.0, 1000 * MB, False, 10_000 * MB, 1000 * MB - 100 * MB - 50 * MB),
    ("auto", 0.0, 120 * MB, False, 10_000 * MB, 0),  # less than the rest of the model and the slabs: stream all
    ("auto", 0.0, 1000 * MB, False, 500 * MB, 500 * MB - 50 * MB),  # granted more than is really free
    ("auto", 0.0, 0, True, 2000 * MB, 2000 * MB - 50 * MB),  # "room for everything" (--highvram): what is free
    ("auto", 0.0, 0, True, 20 * MB, 0),
])
def test_resident_budget(residency, gb, budget, full_load, free, expected):
    memory, settings = pack_module("nodes.memory"), pack_module("nodes.settings")
    chosen = settings.OffloadSettings(residency=residency, resident_gb=gb)  # prefetch 1: two 25 MB slabs
    plan = memory.plan_blocks(chosen, [25 * MB] * 3, free, other_bytes=100 * MB, granted_bytes=None if full_load else budget)
    assert plan.resident_bytes == expected


def test_load_with_a_given_budget_keeps_what_fits_and_accounts_it(models):
    model = offload(load_plain(), residency="auto", prefetch=1)
    device = torch.device("cpu")
    model.load(device, lowvram_model_memory=1 << 40, full_load=True)
    handle = offload_handle(model)
    group = handle.groups[0].nbytes
    other = model.model_size() - handle.stats()["host_bytes"]  # auto on the CPU asks for all of it
    for fitting_groups in (0, 1, 2):
        budget = other + 2 * group + fitting_groups * group + group // 2  # the rest + 2 slabs + n groups
        model.unpatch_model(device)
        model.load(device, lowvram_model_memory=budget, full_load=False)
        assert handle.stats()["resident_groups"] == fitting_groups
        assert model.loaded_size() == other + handle.device_bytes_needed() <= budget
    model.detach()


def test_fixed_plans_ask_comfyui_only_for_what_they_use(models):
    model = offload(load_plain(), residency="stream_all", prefetch=1)
    plain_size = load_plain().model_size()
    run_txt2img(model, seed=10)
    handle = offload_handle(model)
    assert model.model_size() == plain_size - raw_block_bytes(model) + 2 * handle.groups[0].nbytes  # two slabs
    assert model.loaded_size() == model.model_size()


def test_a_build_through_the_node_plans_its_groups_once(models):
    """A model offloaded with a resident budget, built and loaded by its first run (ComfyUI asks its size on the
    way): its groups are planned once for that budget, for the build's host copies and pins and for the load."""
    model = offload(load_plain(), residency="budget", resident_gb=0.00029)  # (a budget no other test plans)
    search = pack_module("offload_core").residency._plans_by_resident_bytes
    runs = plannings(lambda: run_txt2img(model, seed=7, steps=2), search)
    sizes = [g.nbytes for g in offload_handle(model).groups]
    assert [budget for group_bytes, budget in runs if group_bytes == sizes] == [int(0.00029 * 2**30)]


def test_an_interrupt_in_the_call_that_learns_the_entries_leaves_no_watch_behind(models):
    """ComfyUI 0.33's interrupt is a ``BaseException`` raised inside a forward, after which torch runs no forward
    hook of the diffusion model: the watch of the call that learns the entries still comes off the torch function
    mode stack (the sampler's cleanup takes it), so no later torch call goes through it, and the model samples as
    before."""
    import comfy.model_management as mm

    expected = run_txt2img(load_plain(), seed=7, steps=2).latent
    model = offload(load_plain())

    def interrupt(module, args):
        raise mm.InterruptProcessingException()

    hook = model.model.diffusion_model.transformer_blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(mm.InterruptProcessingException):
        run_txt2img(model, seed=7, steps=2)
    hook.remove()
    assert torch._C._len_torch_function_stack() == 0
    assert torch.equal(run_txt2img(model, seed=7, steps=2).latent, expected)
    assert torch._C._len_torch_function_stack() == 0
