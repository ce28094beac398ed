"""Allocations made while the copy stream was current, per step, with a low-rank patch on three weights
(issue 32, item 3), counted by the stream checker (``testbed/stream_checker.py``'s ``allocations_on``): no GPU needed.

Under cudaMallocAsync a block freed on the copy stream can be handed to the compute stream, which the driver then
orders after the copy stream's later work; so the copy stream should allocate nothing.

    python bench/copy_stream_allocations.py
"""
from __future__ import annotations

import gc
import logging
import tempfile
from pathlib import Path

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
import torch

from testbed.stream_checker import StreamChecker
from testbed.core_faults import PATCHED, LowRankPatch, offloaded_on_a_route

log = logging.getLogger("copy_stream_allocations")


def per_step(route: str, resident: bool, steps: int = 4) -> list[int]:
    checker = StreamChecker()
    torch.cuda.cudart = lambda: checker.cudart
    with checker, tempfile.TemporaryDirectory() as folder:
        _, offloaded, x, handle = offloaded_on_a_route(Path(folder), checker, route, resident)
        handle.set_onload_patch(LowRankPatch(), PATCHED)
        copy_stream = handle._transfers.copy_stream.name
        counts = []
        with torch.inference_mode():
            for _ in range(steps):
                before = checker.allocations_on[copy_stream]
                offloaded(x)
                counts.append(checker.allocations_on[copy_stream] - before)
        handle.remove()
        gc.collect()
    return counts


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for route in ("direct", "staged"):
        for resident in (False, True):
            log.info("%-6s resident=%-5s copy-stream allocations per step: %s", route, resident,
                     per_step(route, resident))


if __name__ == "__main__":
    main()
