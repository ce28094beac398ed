"""Reads around the page cache (issue 40, item 2): groups kept in place, none of their bytes kept cached, gathered
from a cold file into a staging buffer on a worker thread, as the gather worker does on a CUDA device.

The model file of ``gather_rate.py`` (Qwen-Image-shaped bfloat16 blocks, tensors at unaligned offsets), evicted
from the page cache before every measurement (``posix_fadvise(DONTNEED)``), gathered group by group by
``HostCopy``:

- *through the cache*: as before issue 40's direct reads: faults on the mapping read the pages into the page
  cache, which the engine releases after each gather (the file opened without ``O_DIRECT``);
- *around the cache*: the bytes read straight from the disk into the buffer (``hostmem.FileRead``), in pieces
  the copy's threads share.

Per case, GB/s min / median / max over interleaved rounds, the bytes the process read from storage
(``/proc/self/io``) per byte gathered, and the page cache the file held after the gathers.

    .venv/bin/python bench/read_around_rate.py --rounds 5 --mb 450
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path)
from gather_rate import gather_seconds, mirrors, write_model
from offload_core import hostmem
from offload_core.gather import HostCopy
from reporting import fmt, markdown_table


def evict(path: Path) -> None:
    with open(path, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_bytes() -> int:
    """What this process has read from storage so far (every thread)."""
    line = next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("read_bytes"))
    return int(line.split()[1])


def cached_bytes(path: Path) -> int:
    whole = hostmem.map_file(path)
    return whole.numel() - hostmem.uncached_bytes(whole)


def measure(path: Path, blocks, around: bool, threads: int, worker: ThreadPoolExecutor) -> tuple[float, float, int]:
    """(GB/s, bytes read from storage per byte gathered, page cache held after) for one cold pass."""
    open_direct = hostmem.open_direct
    if not around:
        hostmem.open_direct = lambda descriptor: None
    try:
        groups = mirrors(path, blocks)
    finally:
        hostmem.open_direct = open_direct
    for group in groups:
        group.cached_bytes = 0
    assert all(g.reads_around_cache for g in groups) == around, "the file system has no direct reads"
    buffers = [torch.empty(max(g.nbytes for g in groups), dtype=torch.uint8) for _ in range(2)]
    evict(path)
    total, before = sum(g.nbytes for g in groups), read_bytes()
    seconds = gather_seconds(groups, buffers, HostCopy(threads), worker)
    return total / seconds / 1e9, (read_bytes() - before) / total, cached_bytes(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mb", type=int, default=450)
    args = parser.parse_args()
    cases = {"through the cache, 1 thread": (False, 1), "through the cache, 2 threads": (False, 2),
             "around the cache, 1 thread": (True, 1), "around the cache, 2 threads": (True, 2)}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.bin"
        blocks = write_model(path, args.mb)
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        worker = ThreadPoolExecutor(max_workers=1)
        for _ in range(args.rounds):
            for name, (around, threads) in cases.items():
                results[name].append(measure(path, blocks, around, threads, worker))
        worker.shutdown()
        size = path.stat().st_size
    rows = []
    for name, runs in results.items():
        rates = [rate for rate, _, _ in runs]
        rows.append([name, f"{fmt(min(rates))} / **{fmt(statistics.median(rates))}** / {fmt(max(rates))}",
                     fmt(statistics.median(r for _, r, _ in runs), 2),
                     fmt(statistics.median(c for _, _, c in runs) / 1e6, 0)])
    print(f"{size / 1e6:.0f} MB file, {len(blocks)} groups, {args.rounds} rounds, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(markdown_table(["gather", "GB/s min / **median** / max", "read from storage ÷ gathered",
                          "page cache held after MB"], rows))


if __name__ == "__main__":
    main()
