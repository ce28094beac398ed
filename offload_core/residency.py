"""Which groups stay on the device: as many as the budget holds, spread between the streamed ones."""
from __future__ import annotations


def plan_residency(group_bytes: list[int], budget: int) -> list[bool]:
    """``resident[i]`` for each group, fitting ``sum(resident bytes) <= budget``.

    The streamed groups are spaced evenly through the execution order, so each streamed copy has
    resident compute in front of it to hide under, instead of all the copies piling up at the end.
    """
    n = len(group_bytes)
    for streamed_count in range(n + 1):
        streamed = _evenly_spaced(n, streamed_count)
        if sum(b for i, b in enumerate(group_bytes) if i not in streamed) <= budget:
            return [i not in streamed for i in range(n)]
    return [False] * n  # unreachable: with every group streamed nothing is resident


def _evenly_spaced(n: int, count: int) -> set[int]:
    """``count`` indices out of ``range(n)``, each in the middle of its share of the range."""
    return {int((j + 0.5) * n / count) for j in range(count)} if count else set()


def planned_slabs(streamed_groups: int, prefetch: int) -> int:
    """Slabs the streamed groups cycle through: one running, ``prefetch`` being filled."""
    return min(prefetch + 1, streamed_groups)


def device_footprint(group_bytes: list[int], resident: list[bool], prefetch: int) -> int:
    """Device bytes held while sampling: the resident groups plus the slabs the streamed ones cycle through."""
    streamed = [b for b, r in zip(group_bytes, resident) if not r]
    slabs = planned_slabs(len(streamed), prefetch)
    return sum(b for b, r in zip(group_bytes, resident) if r) + slabs * max(streamed, default=0)
