"""Pins per sampling run (issue 32, item 2), counted by the CUDA stand-in (``testbed/stream_checker.py``'s
``CheckedCudart``, a ``FakeCudart`` that records every successful call): no GPU needed.

A run is what the nodes do per sampling run: ``handle.pin_streamed()`` (the patcher's ``pre_run``) and a
forward; in the back-off setting the nodes' replan comes first and the last block runs out of memory once; in
the reload setting the nodes' load comes first (a replan, then ``onload_resident``), as when two models take
turns. The steady state (the 4th run) is printed, in largest groups of bytes (the staging ring is two of them),
with the copies that went through a staging buffer (the resident groups' loads through a ring among them).

    python bench/pins_per_run.py
"""
from __future__ import annotations

import logging

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
import torch

from offload_core import apply_group_offload, call_backing_off
from testbed.stream_checker import StreamChecker
from testbed.core_faults import out_of_memory_inside
from testbed.core_models import make_pair

log = logging.getLogger("pins_per_run")


def _counts(cudart, since: int) -> tuple[int, int, int, int]:
    calls = cudart.calls[since:]
    registered = [size for kind, _, size in calls if kind == "register"]
    unregistered = [size for kind, _, size in calls if kind == "unregister"]
    return len(registered), sum(registered), len(unregistered), sum(unregistered)


def measure(name: str, setup, runs: int = 4, back_off: bool = False, reload: bool = False) -> None:
    checker = StreamChecker()
    torch.cuda.cudart = lambda: checker.cudart
    with checker, torch.inference_mode():
        reference, offloaded, x = make_pair("cpu", depth=12)
        handle = setup(checker, offloaded)
        offloaded(x)  # the first run learns the order
        per_run = []
        for _ in range(runs):
            since, discards, staged = len(checker.cudart.calls), checker.discards, handle.ledger.staged_copies
            if back_off:
                handle.set_resident_bytes(sum(g.nbytes for g in handle.groups))
            if reload:
                handle.set_resident_bytes(sum(g.nbytes for g in handle.groups if g.resident))
                handle.onload_resident()
            handle.pin_streamed()
            if back_off:
                with out_of_memory_inside(offloaded.blocks[11], failures=1):
                    out = call_backing_off(handle, lambda: offloaded(x))
            else:
                out = offloaded(x)
            assert torch.equal(out, reference(x))
            per_run.append((*_counts(checker.cudart, since), checker.discards - discards,
                            handle.ledger.staged_copies - staged))
        group = max(g.nbytes for g in handle.groups)
        handle.remove()
    registered, registered_bytes, unregistered, unregistered_bytes, syncs, staged = per_run[-1]
    log.info("%-40s per run: %2d cudaHostRegister (%4.1f largest groups), %2d cudaHostUnregister (%4.1f largest "
             "groups), %d device syncs for refusals, %2d staged copies", name, registered, registered_bytes / group,
             unregistered, unregistered_bytes / group, syncs, staged)


def _past_a_limit(checker, model):
    group = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    checker.cudart.driver_limit = 6 * group + group // 2
    return apply_group_offload(model, model.blocks, "cpu", runtime=checker)


def _half_in_place(checker, model):
    budget = sum(p.numel() * p.element_size() for p in model.blocks.parameters()) // 2
    return apply_group_offload(model, model.blocks, "cpu", runtime=checker, host_budget=budget)


def _half_resident(checker, model):
    resident = sum(p.numel() * p.element_size() for p in model.blocks.parameters()) // 2
    return apply_group_offload(model, model.blocks, "cpu", runtime=checker, resident_bytes=resident)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    measure("all packed, all pinned", lambda c, m: apply_group_offload(m, m.blocks, "cpu", runtime=c))
    measure("past a pinned-memory limit (6.5 of 12)", _past_a_limit)
    measure("half the groups kept in place", _half_in_place)
    measure("all resident, one back-off per run",
            lambda c, m: apply_group_offload(m, m.blocks, "cpu", runtime=c), back_off=True)
    measure("all packed, all pinned, half resident", _half_resident)
    measure("the same, reloaded each run", _half_resident, reload=True)


if __name__ == "__main__":
    main()
