"""Host budget in a box (issue 33, its CPU part): the model file twice the RAM free, on the CPU.

The 458 MB float32 Qwen-Image-shaped model of ``bench/host_budget.py``, through this pack's loader with
nothing packed (what ``host_memory = auto`` packs when the RAM free is below its headroom), sampled in a
fresh process in a *box*: a memory cgroup (v1) the driver enters once the model is loaded, which holds
the page cache it reads and the anonymous memory it adds while sampling to a limit. A balloon of
touched anonymous memory would do the same for the whole machine, and squeeze everyone else on it; the
box squeezes this process only. Its limit: the anonymous memory a first, unlimited run added at its
peak (the slabs, the activations), plus half the model file for the page cache.

Three runs, each with the file's pages evicted first (``posix_fadvise(DONTNEED)``):

- *unlimited*: the box only counts (calibration: the anonymous memory a run adds);
- *LRU*: the kernel's page cache as it is, with half the groups' bytes of room;
- *stable part*: the same box, the groups that fit (``hostmem.groups_kept_cached``, less two groups of
  room for the one being gathered and the one read ahead) stay cached, the others' pages are released
  after each of their forwards (``hostmem.release_pages``).

Per step, the bytes the process read from storage (``/proc/self/io``) beside what the file tier
predicts: all the groups kept in place when they are more than the cache holds (a cyclic read bigger
than an LRU cache misses on every page), only the released ones with the stable part.

    .venv/bin/python bench/host_budget_box.py            # prints the section and writes it to BENCHMARKS.md
    .venv/bin/python bench/host_budget_box.py --dry-run  # prints it only
    .venv/bin/python bench/host_budget_box.py --smoke    # a 4-block model, 4 steps; prints it only
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_paths  # noqa: F401  (puts tests/ and the repository root on sys.path)
from host_budget import MB, STEPS, machine, model_dir, versions
from host_budget_driver import run_in_fresh_process
from offload_core.hostmem import groups_kept_cached
from reporting import fmt, markdown_table, replace_section
from test_host_budget import UNET_NAME

log = logging.getLogger("host_budget_box")

HEADING = "Host budget in a box: the model twice the RAM free (CPU, issue 33)"
CGROUPS = Path("/sys/fs/cgroup/memory")
SMOKE_STEPS = 4  # the figures are the steps from the third on
# A tiny model's box is mostly anonymous memory, which a run's peak may exceed by a few MB (no swap: killed).
SMOKE_ANON_MARGIN = 64 * MB


def memory_cgroup() -> Path:
    """This process's memory cgroup (v1), where the box is made."""
    line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line)
    return CGROUPS / line.split(":", 2)[2].lstrip("/")


@contextlib.contextmanager
def box(limit_bytes: int | None) -> Iterator[Path]:
    """A child memory cgroup of this process's, limited to ``limit_bytes`` (None: unlimited), removed afterwards."""
    path = memory_cgroup() / f"host-budget-box-{os.getpid()}"
    path.mkdir()
    try:
        if limit_bytes is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield path
    finally:
        path.rmdir()


def boxed_run(models, version, folder: Path, name: str, limit: int | None, keep: int | None,
              steps: int) -> dict[str, Any]:
    spec = {"models": str(models.base_dir), "unet_name": UNET_NAME, "via": "loader", "steps": steps,
            "offload": {"host_memory": "budget", "host_gb": 0.0}, "latent": str(folder / f"{name}.pt"),
            "evict": "fadvise", **({} if keep is None else {"keep_cached_bytes": keep})}
    with box(limit) as cgroup:
        run = run_in_fresh_process({**spec, "box": str(cgroup)}, version.python, version.comfyui)
    log.info("%s: %s", name, [round(read / MB) for read in run["call_read_bytes"]])
    return run


def anonymous_peak(unlimited: dict[str, Any]) -> int:
    """The anonymous memory an unlimited run added at its peak: the box's peak less the page cache it held then
    (all it read: nothing evicts it in an unlimited box)."""
    return unlimited["box_peak_bytes"] - unlimited["box_stats"][-1]["total_cache"]


def row(name: str, run: dict[str, Any], limit: int | None, predicted: float) -> list[str]:
    later = slice(2, None)  # the first step reads the groups once, the second finds what the first left
    stats, boxes = run["calls"], run["box_stats"]
    from_disk = [after["gathered_from_disk_bytes"] - before["gathered_from_disk_bytes"]
                 for before, after in zip(stats, stats[1:])]
    return [name, "—" if limit is None else fmt(limit / MB, 0), fmt(statistics.median(run["call_seconds"][later]), 3),
            fmt(predicted / MB, 0), fmt(statistics.median(run["call_read_bytes"][later]) / MB, 0),
            fmt(statistics.median(from_disk[1:]) / MB, 0), fmt(boxes[-1]["total_cache"] / MB, 0),
            fmt(max(b["total_rss"] for b in boxes) / MB, 0), fmt(run["box_peak_bytes"] / MB, 0)]


HEADERS = ["run", "box limit MB", "s/step", "predicted from storage MB/step", "read from storage MB/step",
           "gathered from disk (mincore) MB/step", "page cache in the box at the end MB", "anonymous in the box MB",
           "box peak MB"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the section, leave BENCHMARKS.md as it is")
    parser.add_argument("--smoke", action="store_true", help="a 4-block model, 4 steps; implies --dry-run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    version, started = versions(None)[0], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="host-budget-box-") as folder:
        models, steps = model_dir(Path(folder), smoke=args.smoke), SMOKE_STEPS if args.smoke else STEPS
        room = (models.models_dir / "diffusion_models" / UNET_NAME).stat().st_size // 2
        free = boxed_run(models, version, Path(folder), "unlimited", None, None, steps)
        limit = anonymous_peak(free) + room + (SMOKE_ANON_MARGIN if args.smoke else 0)
        sizes = free["in_place_group_bytes"]
        keep = room - 2 * max(sizes)
        kept = sum(size for size, cached in zip(sizes, groups_kept_cached(sizes, keep)) if cached)
        lru = boxed_run(models, version, Path(folder), "lru", limit, None, steps)
        stable = boxed_run(models, version, Path(folder), "stable", limit, keep, steps)
    in_place = sum(sizes)
    rows = [row("unlimited (calibration)", free, None, 0), row("LRU", lru, limit, in_place),
            row("stable part", stable, limit, in_place - kept)]
    markdown = "\n\n".join([
        f"Measured by `.venv/bin/python bench/host_budget_box.py` on {time.strftime('%Y-%m-%d')}, "
        f"{(time.monotonic() - started) / 60:.1f} min; {machine()}; ComfyUI {version.name} with `--cpu`.",
        f"{in_place / MB:.0f} MB of groups kept in place ({len(sizes)} groups), a box of {limit / MB:.0f} MB: "
        f"{room / MB:.0f} MB of page cache (half the file) beside the anonymous memory the unlimited run added. "
        f"The stable part keeps {kept / MB:.0f} MB cached. Steps from the third on (medians).",
        markdown_table(HEADERS, rows),
    ])
    print(markdown)
    if not (args.smoke or args.dry_run):
        replace_section(HEADING, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
