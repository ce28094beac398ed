"""The prefetch schedule: the order the groups run in, learnt from the first forward, and which streamed
groups to copy ahead of each one.

Pure bookkeeping on group indices: no tensors, no streams. The handle tells it which group runs
(``saw``) and which groups stream (``use_plan``); it answers which groups follow one (``after``).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Schedule:
    """The learnt order of ``group_count`` groups and, once it is complete, the streamed groups after each."""

    def __init__(self, group_count: int, prefetch: int) -> None:
        self.group_count = group_count
        self.prefetch = prefetch  # the depth in effect: how many streamed groups are copied ahead
        self._streamed = [True] * group_count
        self._trace: list[int] = []  # the group indices in the order they first ran
        self._following: dict[int, list[int]] | None = None  # group index -> the streamed groups after it

    @property
    def learnt(self) -> bool:
        return self._following is not None

    def saw(self, index: int) -> None:
        """Group ``index`` runs. Until the order is learnt, record it; the order is complete once every
        group ran or the first one runs again."""
        if self.learnt:
            return
        if index not in self._trace:
            self._trace.append(index)
        if index == self._trace[0] and len(self._trace) > 1 or len(self._trace) == self.group_count:
            missing = self.group_count - len(self._trace)
            if missing:
                log.warning("%d offloaded group(s) did not run in the first forward; they will load on demand", missing)
            self._following = self._plan_following()

    def use_plan(self, streamed: list[bool], prefetch: int) -> None:
        """Which groups stream, and the depth; a learnt lookahead follows them."""
        self._streamed = list(streamed)
        self.prefetch = prefetch
        if self.learnt:
            self._following = self._plan_following()

    def forget_unfinished(self) -> None:
        """Forget an order a forward that failed part-way left incomplete (a learnt one stays)."""
        if not self.learnt:
            self._trace.clear()

    def after(self, index: int, count: int | None = None) -> list[int]:
        """The next ``count`` (by default ``prefetch``: those to copy ahead of their use while group ``index``
        runs) streamed groups after group ``index``, nearest first (none before the order is learnt, or for a
        group that did not run in the first forward)."""
        return (self._following or {}).get(index, [])[: self.prefetch if count is None else count]

    def _plan_following(self) -> dict[int, list[int]]:
        """For each group in the learnt order, the streamed groups after it (cyclic), nearest first."""
        order = self._trace
        streamed_positions = [p for p, index in enumerate(order) if self._streamed[index]]
        plan = {}
        for p, index in enumerate(order):
            after = [q for q in streamed_positions if q > p] + [q for q in streamed_positions if q <= p]
            plan[index] = [order[q] for q in after if order[q] != index]
        return plan
