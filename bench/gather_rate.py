"""Gather rate (issue 32, item 4): groups kept in place gathered from the page cache into a staging buffer.

A model-sized file (``--mb``, default 450 MB: Qwen-Image-shaped blocks of width 1280 in bfloat16 (99 MB), one
group each, their tensors at unaligned offsets as in a .safetensors file) is written, read once into
the page cache and mapped read-only, as the loader maps it. Its groups' ``InPlaceMirror``s are gathered
one after the other into a staging buffer on a worker thread, as the gather worker does on the GPU
path, by two copies:

- ``torch``: today's copy, ``Tensor.copy_`` tensor by tensor;
- ``HostCopy``: ``offload_core.gather.HostCopy`` (the whole group at once, memmove in chunks, off the GIL and OpenMP);

each alone and while the main thread runs a matmul loop (the sampling thread computing meanwhile), each
from a mapping made anew (every page faulted in by the gather) and from one already faulted in. Every
round runs every case once, in turn; the figures are GB/s min / median / max over the rounds, and the
ratio HostCopy/torch taken within a round.

    .venv/bin/python bench/gather_rate.py                 # 7 rounds, prints a markdown table
    .venv/bin/python bench/gather_rate.py --rounds 3 --mb 200 --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path)
from offload_core.gather import HostCopy
from offload_core.hostmem import FileMappings, SourceFiles, map_file
from offload_core.mirror import CopyFn, InPlaceMirror, pack_layout
from reporting import fmt, markdown_table

WIDTH = 1280
DTYPE = torch.bfloat16
HEADER_BYTES = 1000  # the tensors lie at offsets no page boundary aligns, as in a .safetensors file
COMPUTE_SIZE = 768  # the main thread's matmul while a gather runs


def block_shapes(width: int = WIDTH) -> list[tuple[int, ...]]:
    """One Qwen-Image-shaped block: attention, its norms and biases, the MLP, the modulation."""
    attention = [(width, width)] * 8 + [(width,)] * 8 + [(128,)] * 4
    mlp = [(4 * width, width), (4 * width,), (width, 4 * width), (width,)] * 2
    return attention + mlp + [(6 * width, width), (6 * width,)]


def write_model(path: Path, megabytes: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """A file of random blocks of about ``megabytes``; each block's (offset, shape) per tensor."""
    shapes = block_shapes()
    block_bytes = sum(torch.Size(s).numel() for s in shapes) * DTYPE.itemsize
    blocks, offset = [], HEADER_BYTES
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as file:
        file.write(bytes(HEADER_BYTES))
        for _ in range(max(1, megabytes * 10**6 // block_bytes)):
            blocks.append([])
            for shape in shapes:
                data = torch.randint(0, 256, (torch.Size(shape).numel() * DTYPE.itemsize,), dtype=torch.uint8,
                                     generator=generator)
                file.write(data.numpy().tobytes())
                blocks[-1].append((offset, shape))
                offset += data.numel()
    return blocks


def mirrors(path: Path, blocks: list[list[tuple[int, tuple[int, ...]]]]) -> list[InPlaceMirror]:
    """The blocks' groups kept in place: views of the file mapped anew."""
    mapped = map_file(path)
    mappings, sources, groups = FileMappings(), SourceFiles(), []
    for block in blocks:
        views = [mapped[o : o + torch.Size(s).numel() * DTYPE.itemsize].view(DTYPE).view(s) for o, s in block]
        segments, nbytes = pack_layout(views)
        groups.append(InPlaceMirror(segments, nbytes, views, mappings, sources))
    return groups


def torch_copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


def gather_seconds(groups: list[InPlaceMirror], buffers: list[torch.Tensor], copy: CopyFn,
                   worker: ThreadPoolExecutor) -> float:
    """Every group gathered in turn on ``worker`` into the staging buffers, used in turn."""
    def gather_all() -> float:
        started = time.perf_counter()
        for i, group in enumerate(groups):
            group.gather_into(buffers[i % len(buffers)][: group.nbytes], copy)
        return time.perf_counter() - started
    return worker.submit(gather_all).result()


def while_computing(measure: Callable[[], float]) -> float:
    """``measure()`` on this thread's behalf while the main thread runs matmuls until it is done."""
    done = threading.Event()
    result: list[float] = []
    runner = threading.Thread(target=lambda: (result.append(measure()), done.set()))
    a = torch.randn(COMPUTE_SIZE, COMPUTE_SIZE)
    runner.start()
    while not done.is_set():
        a = torch.tanh(a @ a)
    runner.join()
    return result[0]


def run(megabytes: int, rounds: int, threads: int | None) -> list[list[str]]:
    copies = {"torch": torch_copy, "HostCopy": HostCopy(threads)}
    rates: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.bin"
        blocks = write_model(path, megabytes)
        with open(path, "rb") as file:  # into the page cache
            while file.read(64 * 2**20):
                pass
        faulted = mirrors(path, blocks)
        total = sum(g.nbytes for g in faulted)
        buffers = [torch.empty(max(g.nbytes for g in faulted), dtype=torch.uint8) for _ in range(2)]
        worker = ThreadPoolExecutor(max_workers=1)
        gather_seconds(faulted, buffers, torch_copy, worker)  # faults the pages of ``faulted`` in
        for _ in range(rounds):
            for mapping in ("mapped anew", "faulted in"):
                for load in ("alone", "main thread computing"):
                    for name, copy in copies.items():
                        groups = mirrors(path, blocks) if mapping == "mapped anew" else faulted
                        measure = lambda: gather_seconds(groups, buffers, copy, worker)  # noqa: E731
                        seconds = measure() if load == "alone" else while_computing(measure)
                        rates.setdefault((mapping, load, name), []).append(total / seconds / 1e9)
        worker.shutdown()
    rows = []
    for mapping in ("mapped anew", "faulted in"):
        for load in ("alone", "main thread computing"):
            old, new = rates[(mapping, load, "torch")], rates[(mapping, load, "HostCopy")]
            ratio = [n / o for n, o in zip(new, old)]
            rows.append([mapping, load, _spread(old), _spread(new), _spread(ratio, "×")])
    print(f"{total / 1e6:.0f} MB in {len(blocks)} groups, {rounds} rounds, {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}, HostCopy by {copies['HostCopy'].threads} thread(s)")
    return rows


def _spread(values: list[float], unit: str = "") -> str:
    return f"{fmt(min(values))} / **{fmt(statistics.median(values))}** / {fmt(max(values))}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=450, help="model file size in MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, help="HostCopy's threads (default: as the runtime chooses)")
    args = parser.parse_args()
    rows = run(args.mb, args.rounds, args.threads)
    print(markdown_table(["mapping", "while", "torch GB/s (min / median / max)", "HostCopy GB/s", "HostCopy / torch"],
                         rows))


if __name__ == "__main__":
    main()
