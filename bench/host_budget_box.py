"""Host budget in a box (issues 33 and 40): the model file twice the page cache it may hold, on the CPU.

The 458 MB float32 Qwen-Image-shaped model of ``bench/host_budget.py``, through this pack's loader, sampled in
a fresh process in a *box*: a memory cgroup (v1) that holds the page cache it reads and the anonymous memory it
adds to a limit. A balloon of touched anonymous memory would do the same for the whole machine, and squeeze
everyone else on it; the box squeezes this process only.

Per ComfyUI version, each run with the file's pages evicted first (``posix_fadvise(DONTNEED)``):

- *unlimited*: the box only counts (calibration: the anonymous memory a run adds, as it loads and as it samples);
- for a page cache of half and of a quarter of the file (the box: what the unlimited run added, plus that),
  nothing packed (``host_gb = 0``, what ``auto`` packs where RAM is short), the process entering the box once
  loaded:
  - *LRU*: the kernel's page cache as it is (the engine's policy switched off by the driver), as before;
  - *engine, through the cache*: the engine keeps the first groups that fit the room cached, reads the others
    through the page cache and releases their pages after each gather (before issue 40's direct reads);
  - *engine*: the defaults: the same, with the others read around the page cache where the file system reads so
    (``GroupOffloadHandle.keep_cached``, ``InPlaceMirror.gather_into``);
- *container*: the defaults (``host_memory = auto``), the process entering the box of half the file before it
  loads, as in a container: ``auto`` sees the box's limit.

Per step, the bytes the process read from storage (``/proc/self/io``) beside what the file tier predicts: all
the groups kept in place under the LRU (a cyclic read bigger than the cache misses on every page), only the
released ones with the engine's policy.

    .venv/bin/python bench/host_budget_box.py --versions 0.3.75,0.33.0  # writes its section of BENCHMARKS.md
    .venv/bin/python bench/host_budget_box.py --dry-run                 # prints it only
    .venv/bin/python bench/host_budget_box.py --smoke                   # a 4-block model, 4 steps; prints it only
"""
from __future__ import annotations

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

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
from host_budget import MB, STEPS, machine, model_dir, versions
from testbed.host_budget_driver import run_in_fresh_process
from reporting import fmt, markdown_table, publish, section_arguments
from testbed.host_budget_driver import UNET_NAME

log = logging.getLogger("host_budget_box")

HEADING = "Host budget in a box: the model twice the page cache it may hold (CPU, issues 33 and 40)"
CGROUPS = Path("/sys/fs/cgroup/memory")
SMOKE_STEPS = 4  # the figures are the steps from the third on
# A tiny model's box is mostly anonymous memory, which a run's peak may exceed by a few MB (no swap: killed).
SMOKE_ANON_MARGIN = 64 * MB
ROOMS = {"half": 2, "quarter": 4}  # the page cache the box holds: the file's size divided by this
#: The page-cache policies compared in each box: the driver's options for them.
POLICIES = {"LRU": {"lru": True}, "engine, through the cache": {"through_cache": True}, "engine": {}}


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


def boxed_run(models, version, folder: Path, name: str, limit: int | None, steps: int, **options: Any) -> dict[str, Any]:
    """One run in a box of ``limit``; ``options``: the driver's (``lru``, ``enter_box_before_load``, ``offload``)."""
    spec = {"models": str(models.base_dir), "unet_name": UNET_NAME, "via": "loader", "steps": steps,
            "offload": {"host_memory": "budget", "host_gb": 0.0}, "latent": str(folder / f"{name}.pt"),
            "evict": "fadvise", **options}
    with box(limit) as cgroup:
        run = run_in_fresh_process({**spec, "box": str(cgroup)}, version.python, version.comfyui)
    run["latent"] = torch.load(spec["latent"])
    log.info("%s: %s", name, [round(read / MB) for read in run["call_read_bytes"]])
    return run


def anonymous_peak(unlimited: dict[str, Any]) -> int:
    """The anonymous memory an unlimited run added at its peak while sampling: the box's peak less the page cache
    it held then (all it read: nothing evicts it in an unlimited box)."""
    return unlimited["box_peak_bytes"] - unlimited["box_stats"][-1]["total_cache"]


def loading_growth(unlimited: dict[str, Any]) -> int:
    """The anonymous memory loading added (RssAnon's peak while loading, less where it started)."""
    marks = unlimited["rss_anon"]
    return marks["loaded"]["peak"] - marks["before"]["now"]


def predicted(run: dict[str, Any], lru: bool) -> int:
    """What the file tier reads from storage per step: every group kept in place under the LRU where they need more
    page cache than the box holds; the ones the engine releases with its policy."""
    stats = run["calls"][-1]
    return stats["in_place_bytes"] if lru else stats["in_place_bytes"] - stats["kept_cached_bytes"]


def minimum(run: dict[str, Any], cache_room: int) -> int:
    """The fewest bytes a step could read from storage: the groups kept in place less the page cache the box has
    room for beside the run's anonymous memory (``cache_room``)."""
    return max(0, run["calls"][-1]["in_place_bytes"] - cache_room)


def row(name: str, run: dict[str, Any], limit: int | None, expected: float | None, reference: torch.Tensor,
        least: int | None = None) -> list[str]:
    later = slice(2, None)  # the first step reads the groups once, the second finds what the first left
    boxes, stats = run["box_stats"], run["calls"][-1]
    read = statistics.median(run["call_read_bytes"][later])
    return [name, "—" if limit is None else fmt(limit / MB, 0), fmt(stats["packed_bytes"] / MB, 0),
            fmt(stats["kept_cached_bytes"] / MB, 0), fmt(statistics.median(run["call_seconds"][later]), 3),
            "—" if expected is None else fmt(expected / MB, 0), fmt(read / MB, 0),
            "—" if not expected else fmt(read / expected, 2), "—" if least is None else fmt(least / MB, 0),
            "—" if not least else fmt(read / least, 2), fmt(boxes[-1]["total_cache"] / MB, 0),
            fmt(max(b["total_rss"] for b in boxes) / MB, 0), fmt(run["box_peak_bytes"] / MB, 0),
            "yes" if torch.equal(run["latent"], reference) else "NO"]


HEADERS = ["run", "box limit MB", "packed MB", "kept cached MB", "s/step", "predicted from storage MB/step",
           "read from storage MB/step", "read ÷ predicted", "box minimum MB/step", "read ÷ minimum", "page cache in the box at the end MB",
           "anonymous in the box MB", "box peak MB", "latent = unlimited's"]


def measure_version(models, version, folder: Path, steps: int, smoke: bool) -> tuple[list[list[str]], str]:
    """The table rows of one ComfyUI version, and a line on its model and boxes."""
    file_bytes = (models.models_dir / "diffusion_models" / UNET_NAME).stat().st_size
    free = boxed_run(models, version, folder, f"{version.name}-unlimited", None, steps)
    anon = anonymous_peak(free) + (SMOKE_ANON_MARGIN if smoke else 0)
    reference = free["latent"]
    rows = [row("unlimited (calibration)", free, None, None, reference)]
    for share, divisor in ROOMS.items():
        limit = anon + file_bytes // divisor
        for policy, options in POLICIES.items():
            run = boxed_run(models, version, folder, f"{version.name}-{share}-{policy}", limit, steps, **options)
            rows.append(row(f"{share} the file cached: {policy}", run, limit, predicted(run, options.get("lru", False)),
                            reference, minimum(run, file_bytes // divisor)))
    limit = loading_growth(free) + anon + file_bytes // 2
    run = boxed_run(models, version, folder, f"{version.name}-container", limit, steps, offload={},
                    enter_box_before_load=True)
    rows.append(row("container: entered before loading, defaults", run, limit, predicted(run, False), reference,
                    minimum(run, file_bytes // 2)))
    sizes = free["in_place_group_bytes"]
    note = (f"ComfyUI {version.name}: {sum(sizes) / MB:.0f} MB of groups kept in place ({len(sizes)} groups); the run "
            f"added {anon / MB:.0f} MB of anonymous memory sampling, {loading_growth(free) / MB:.0f} MB loading.")
    return [[version.name, *cells] for cells in rows], note


def main(argv: list[str]) -> int:
    args = section_arguments(__doc__, "a 4-block model, 4 steps").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started, rows, notes = time.monotonic(), [], []
    with tempfile.TemporaryDirectory(prefix="host-budget-box-") as folder:
        models, steps = model_dir(Path(folder), smoke=args.smoke), SMOKE_STEPS if args.smoke else STEPS
        for version in versions(args.versions):
            version_rows, note = measure_version(models, version, Path(folder), steps, args.smoke)
            rows += version_rows
            notes.append(note)
    markdown = "\n\n".join([
        f"Measured by `.venv/bin/python bench/host_budget_box.py{' --versions ' + args.versions if args.versions else ''}` on "
        f"{time.strftime('%Y-%m-%d')}, {(time.monotonic() - started) / 60:.1f} min; {machine()}; ComfyUI with "
        f"`--cpu`. Steps from the third on (medians).",
        " ".join(notes),
        markdown_table(["ComfyUI", *HEADERS], rows),
    ])
    publish(HEADING, markdown, write=not (args.smoke or args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
