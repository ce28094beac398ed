"""The cost model (``bench/cost_model.py``): Qwen-Image's shape, the seed's two figures, and the orderings a
model must keep."""
from __future__ import annotations

import dataclasses

import pytest

from cost_model import (
    A100_40G,
    DIFFUSERS_TRUE_CFG,
    H200,
    QWEN_IMAGE,
    Plan,
    Transfer,
    auto_resident_blocks,
    pack_scenarios,
    predict,
    seed_scenarios,
    with_bandwidth,
)

PLANS = [Plan(t) for t in Transfer] + [Plan(Transfer.PINNED_PREFETCH, 30), Plan(Transfer.COPY_BACK, stream_other=True)]


def test_qwen_image_shape_matches_comfyui_and_peers():
    assert QWEN_IMAGE.block_params() == 339_831_296  # ComfyUI's QwenImageTransformerBlock state dict
    assert QWEN_IMAGE.blocks * QWEN_IMAGE.block_bytes == pytest.approx(40.8e9, rel=0.01)  # peers.md §4
    assert DIFFUSERS_TRUE_CFG.image_tokens == 6032
    assert QWEN_IMAGE.block_flops(6032, 128) == pytest.approx(1.9e12, rel=0.05)  # peers.md §4


@pytest.mark.parametrize("scenario", seed_scenarios(), ids=lambda s: s.name)
def test_reproduces_the_seed_within_25_percent(scenario):
    assert scenario.estimate().seconds == pytest.approx(scenario.measured_s, rel=0.25)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.transfer.value}-{p.resident_blocks}")
@pytest.mark.parametrize("gpu", [A100_40G, H200], ids=lambda g: g.name)
def test_more_bandwidth_is_never_slower(gpu, plan):
    times = [predict(with_bandwidth(gpu, f), plan).seconds for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
    assert times == sorted(times, reverse=True)
    if plan.resident_blocks < QWEN_IMAGE.blocks and plan.transfer is not Transfer.PINNED_PREFETCH:
        assert times[0] > times[-1]


@pytest.mark.parametrize("transfer", list(Transfer), ids=lambda t: t.value)
@pytest.mark.parametrize("gpu", [A100_40G, H200], ids=lambda g: g.name)
def test_residency_reduces_time(gpu, transfer):
    times = [predict(gpu, Plan(transfer, resident)).seconds for resident in range(0, 61, 6)]
    assert times == sorted(times, reverse=True)
    assert times[-1] < times[0]


@pytest.mark.parametrize("resident", [0, 20, 54, 60])
@pytest.mark.parametrize("gpu", [A100_40G, H200], ids=lambda g: g.name)
def test_prefetch_is_never_slower_than_synchronous(gpu, resident):
    synchronous = predict(gpu, Plan(Transfer.PINNED_SYNC, resident)).seconds
    prefetched = predict(gpu, Plan(Transfer.PINNED_PREFETCH, resident)).seconds
    assert prefetched <= synchronous


def test_copy_back_is_the_slowest_and_pinned_beats_pageable():
    seconds = {t: predict(A100_40G, Plan(t)).seconds for t in Transfer}
    assert max(seconds, key=seconds.get) is Transfer.COPY_BACK
    slower_pageable = dataclasses.replace(A100_40G, h2d_pageable_gbps=10.0)
    assert predict(slower_pageable, Plan(Transfer.PINNED_SYNC)).seconds < predict(slower_pageable, Plan(Transfer.PAGEABLE_SYNC)).seconds


def test_auto_residency_fits_the_cap():
    for cap in (24 * 2**30, 40 * 2**30):
        blocks = auto_resident_blocks(cap)
        held = blocks * QWEN_IMAGE.block_bytes + QWEN_IMAGE.other_bytes + 2 * QWEN_IMAGE.block_bytes
        assert held <= cap - 4 * 2**30 < held + QWEN_IMAGE.block_bytes
    assert auto_resident_blocks(1e15) == QWEN_IMAGE.blocks
    assert auto_resident_blocks(0) == 0


def test_the_pack_beats_the_seed_on_an_a100():
    best = min(s.estimate().seconds for s in pack_scenarios() if s.gpu is A100_40G)
    assert best < min(s.measured_s for s in seed_scenarios())


def test_bad_residency_is_refused():
    with pytest.raises(ValueError, match="resident_blocks"):
        predict(A100_40G, Plan(Transfer.PINNED_SYNC, 61))
