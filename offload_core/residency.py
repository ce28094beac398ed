"""Which groups stay on the device: as many bytes as the budget holds, streamed ones spread out."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .slabs import slabs_for

#: Resident sums closer than ``PRECISION × budget ÷ groups`` are not told apart (keeps the search small).
PRECISION = 0.01
#: Share of the budget the plan may leave unused to spread the streamed groups more evenly.
SPREAD_ALLOWANCE = 0.04

#: Plans remembered (``plan_residency``): a few models' worth of budgets, a few hundred bytes each.
PLANS_REMEMBERED = 64

#: A partial plan: (resident bytes, unevenness so far, bit mask of the resident groups).
_Plan = tuple[int, float, int]


def plan_residency(group_bytes: list[int], budget: int) -> list[bool]:
    """``resident[i]`` for each group, in execution order, fitting ``sum(resident bytes) <= budget``.

    Bound: the resident bytes are at least the most that any choice of groups keeps within the
    budget, less 5 % of the budget (``PRECISION + SPREAD_ALLOWANCE``). So whenever some choice of
    groups fills the budget, ≥ 95 % of it stays resident, whatever the mix of group sizes.

    Spread: among the plans that meet the bound, the most even one, so that each streamed copy
    has resident compute around it to hide under instead of the copies piling up together.
    Unevenness is the sum, over the groups, of the squared gap between the bytes kept resident up
    to and including that group and the budget's share of the bytes up to there.

    Planned once for each ``group_bytes`` and ``budget``: a model's build (its host copies, the groups it
    pins), its loads and its size asked again and again get that plan, remembered; another budget (a
    load's memory free, an out-of-memory back-off's) plans afresh.
    """
    return list(_planned(tuple(group_bytes), budget))


@functools.lru_cache(maxsize=PLANS_REMEMBERED)
def _planned(group_bytes: tuple[int, ...], budget: int) -> tuple[bool, ...]:
    if budget >= sum(group_bytes):
        return (True,) * len(group_bytes)
    plans = _plans_by_resident_bytes(group_bytes, budget)
    good_enough = max(resident for resident, _, _ in plans) - SPREAD_ALLOWANCE * budget
    _, _, mask = min((p for p in plans if p[0] >= good_enough), key=lambda p: (p[1], -p[0]))
    return tuple(bool(mask >> i & 1) for i in range(len(group_bytes)))


def _plans_by_resident_bytes(group_bytes: tuple[int, ...], budget: int) -> list[_Plan]:
    """Complete plans within ``budget``: a dynamic programme over the groups in order that keeps,
    per bucket of resident bytes, the plan with the smallest sum and the most even one.

    Keeping the smallest sum per bucket is what makes the bound hold: for any choice of groups,
    after ``i`` groups some kept plan has a resident sum at most ``i`` buckets below it, never above.
    Plans that can no longer come within ``SPREAD_ALLOWANCE`` of the fullest are dropped; since
    ``SPREAD_ALLOWANCE >= PRECISION``, that is never the plan the bound rests on.
    """
    total = sum(group_bytes)
    bucket = max(1, int(PRECISION * budget / len(group_bytes)))
    share = budget / total
    plans: list[_Plan] = [(0, 0.0, 0)]
    done = 0
    for i, nbytes in enumerate(group_bytes):
        done += nbytes
        lowest: dict[int, _Plan] = {}
        evenest: dict[int, _Plan] = {}
        for resident, unevenness, mask in plans:
            for kept, kept_mask in ((resident, mask), (resident + nbytes, mask | 1 << i)):
                if kept > budget:
                    continue
                plan = (kept, unevenness + (share * done - kept) ** 2, kept_mask)
                key = kept // bucket
                if key not in lowest or plan[:2] < lowest[key][:2]:
                    lowest[key] = plan
                if key not in evenest or (plan[1], plan[0]) < (evenest[key][1], evenest[key][0]):
                    evenest[key] = plan
        plans = [*lowest.values(), *(plan for key, plan in evenest.items() if plan is not lowest[key])]
        hopeless = max(resident for resident, _, _ in plans) - SPREAD_ALLOWANCE * budget - (total - done)
        plans = [plan for plan in plans if plan[0] >= hopeless]
    return plans


def plan_packing(group_bytes: list[int], resident: list[bool], budget: int | None) -> list[bool]:
    """``packed[i]`` for each group: whether it gets a packed host mirror within ``budget`` host bytes (None:
    all do); the others keep their tensors in place and are gathered at each onload.

    The streamed groups come first, spread evenly over the pass (each gather then lies between copies
    from pinned mirrors); then, with what is left, the resident ones, whose host copy is read only
    when their device copy is dropped.
    """
    if budget is None:
        return [True] * len(group_bytes)
    packed = [False] * len(group_bytes)
    left = budget
    streamed = [i for i, stays in enumerate(resident) if not stays]
    share = min(1.0, budget / max(1, sum(group_bytes[i] for i in streamed)))
    due = 0.0
    for i in streamed:  # Bresenham's line: pack a group once the share owed so far reaches half of it
        due += share * group_bytes[i]
        if due >= group_bytes[i] / 2 and group_bytes[i] <= left:
            packed[i], left, due = True, left - group_bytes[i], due - group_bytes[i]
    for i in [*streamed, *(i for i, stays in enumerate(resident) if stays)]:
        if not packed[i] and group_bytes[i] <= left:
            packed[i], left = True, left - group_bytes[i]
    return packed


def planned_slabs(streamed_groups: int, prefetch: int) -> int:
    """Slabs the streamed groups cycle through: what ``prefetch`` needs, at most one per streamed group."""
    return min(slabs_for(prefetch), streamed_groups)


def device_footprint(group_bytes: list[int], resident: list[bool], prefetch: int) -> int:
    """Device bytes held while sampling: the resident groups plus the slabs the streamed ones cycle through."""
    streamed = [b for b, r in zip(group_bytes, resident) if not r]
    slabs = planned_slabs(len(streamed), prefetch)
    return sum(b for b, r in zip(group_bytes, resident) if r) + slabs * max(streamed, default=0)


def backed_off_plan(group_bytes: list[int], resident: list[bool], prefetch: int) -> tuple[list[bool], int] | None:
    """The plan to fall back to after a call ran out of device memory, as (resident, prefetch); None when
    no plan holds less than this one.

    Resident groups go first, until the blocks hold at most half the device memory they held (the
    planner picks the groups that stay, so the streamed ones stay spread out), every group streaming
    when none fits in that half; once every group streams, prefetch drops to 1. Halving reaches the
    bottom in a few tries however many groups are resident. A plan is taken only if it holds less:
    streaming a small group alone needs one buffer of its size, streaming all needs ``slabs_for(prefetch)``
    of the largest.
    """
    held = device_footprint(group_bytes, resident, prefetch)
    every_group_streamed = [False] * len(group_bytes)
    buffers = device_footprint(group_bytes, every_group_streamed, prefetch)
    fewer = plan_residency(group_bytes, max(0, held // 2 - buffers))
    for plan, depth in ((fewer, prefetch), (every_group_streamed, min(prefetch, 1))):
        if device_footprint(group_bytes, plan, depth) < held:
            return plan, depth
    return None


@dataclass(frozen=True)
class Residency:
    """One plan in effect: how many groups stay on the device, the prefetch depth, and the device bytes
    the blocks hold under it (resident groups and streaming buffers)."""

    resident_groups: int
    groups: int
    resident_bytes: int
    prefetch: int
    device_bytes: int

    def __str__(self) -> str:
        return (f"{self.resident_groups} of {self.groups} groups resident, prefetch {self.prefetch} "
                f"({format_bytes(self.device_bytes)} on the device)")


def format_bytes(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
