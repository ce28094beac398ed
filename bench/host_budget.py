"""Host budget (issue 23): a model bigger than the RAM it may take, on the CPU.

The 458 MB float32 Qwen-Image-shaped model of ``tests/bench/test_host_budget.py`` (12 blocks of 37.8 MB),
loaded and sampled in a fresh process per configuration (``testbed/host_budget_driver.py``): this pack's
loader (Load Diffusion Model (Group Offload)) at host budgets of 100, 50, 25 and 0 % of the model file,
Load Diffusion Model + the Group Offload node at the same budgets, and plain ComfyUI (Load Diffusion
Model, no offloading); every group streamed (``stream_all``, prefetch 1), 1 warm-up step and 6 timed
steps (euler, cfg 4, cond and uncond batched: one model call a step).

Each configuration runs with a warm page cache (the model file read through just before the process
starts) and a cold one: right before sampling, the process drops the machine's whole page cache with
``/proc/sys/vm/drop_caches`` where it may write it (other files' pages too: ``--cold fadvise`` spares the
machine's other users), else the file's pages with ``posix_fadvise(POSIX_FADV_DONTNEED)``. Figures are
medians over ``--rounds`` rounds, each of which runs every configuration once; the ratios are taken
within a round, then their median.

    .venv/bin/python bench/host_budget.py                              # writes its section of BENCHMARKS.md
    .venv/bin/python bench/host_budget.py --versions 0.3.75,0.33.0     # both ComfyUI versions of dev.py
    .venv/bin/python bench/host_budget.py --smoke                      # tiny model, 25 % only, prints the section
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
from testbed.comfy_boot import comfyui_path, comfyui_version
from testbed.fixture_models import ModelDir, tiny_qwen_image_file
from testbed.host_budget_driver import DROP_CACHES, run_in_fresh_process
from reporting import fmt, markdown_table, publish
from testbed.host_budget_driver import GiB, MODEL, UNET_NAME

log = logging.getLogger("host_budget")

HEADING = "Host budget: a model bigger than RAM (CPU, issue 23)"
SHARES = (1.0, 0.5, 0.25, 0.0)
STEPS = 7  # the first is the warm-up
SMOKE_MODEL = {"num_layers": 4, "dtype": torch.float32}
MB = 10**6
# A run during which other processes kept more than this share of a core busy is run again, up to RUN_TRIES in all:
# the machine is shared, and another's test run slows a step several times over.
FOREIGN_CPU_LIMIT = 0.25
RUN_TRIES = 4


@dataclass(frozen=True)
class Version:
    """A ComfyUI to run the driver with: its interpreter and checkout."""

    name: str
    python: str
    comfyui: Path


@dataclass(frozen=True)
class Config:
    """One way to load and sample the model: ``via`` plain, loader or node, at a host budget of ``share`` of the
    model file (None for plain), with a cold or warm page cache."""

    via: str
    share: float | None
    cold: bool

    @property
    def path(self) -> str:
        return {"plain": "ComfyUI's Load Diffusion Model", "loader": "this pack's loader",
                "node": "Load Diffusion Model + Group Offload"}[self.via]

    @property
    def budget(self) -> str:
        return "—" if self.share is None else f"{self.share:.0%}"

    @property
    def full(self) -> Config:
        """The same path and page cache at a budget of 100 % (plain: itself)."""
        return self if self.share is None else Config(self.via, 1.0, self.cold)


PLAIN_WARM = Config("plain", None, cold=False)


def configs(shares: Sequence[float]) -> list[Config]:
    """Plain ComfyUI, then the loader and the node at each budget, each warm then cold."""
    ways = [("plain", None), *(("loader", s) for s in shares), *(("node", s) for s in shares)]
    return [Config(via, share, cold) for via, share in ways for cold in (False, True)]


def cold_method(requested: str) -> str:
    """``drop_caches`` where this process may write /proc/sys/vm/drop_caches, else ``fadvise``; or as asked."""
    if requested != "auto":
        return requested
    return "drop_caches" if os.access(DROP_CACHES, os.W_OK) else "fadvise"


def warm_page_cache(path: Path) -> None:
    """Read the file through once, so that the page cache holds it."""
    with open(path, "rb") as file:
        while file.read(1 << 24):
            pass


def spec(config: Config, models: ModelDir, file_bytes: int, latent: Path, evict: str) -> dict[str, Any]:
    """The driver's spec for ``config``: host_gb is ``share`` of the model file, in GiB as the node reads it."""
    offload = {} if config.share is None else {"host_memory": "budget", "host_gb": config.share * file_bytes / GiB}
    return {"models": str(models.base_dir), "unet_name": UNET_NAME, "via": config.via, "offload": offload,
            "latent": str(latent), "steps": STEPS, **({"evict": evict} if config.cold else {})}


def _grew(calls: list[dict[str, Any]], counter: str, first: int, end: int) -> float:
    """How much a ledger counter grew over calls ``first`` to ``end - 1`` (0 without offloading)."""
    before = calls[first - 1].get(counter, 0) if first else 0
    return calls[end - 1].get(counter, 0) - before


def _gather_gbps(calls: list[dict[str, Any]], first: int, end: int) -> float | None:
    """The gather rate over calls ``first`` to ``end - 1``; None where nothing was gathered."""
    seconds = _grew(calls, "gather_seconds", first, end)
    return _grew(calls, "gathered_bytes", first, end) / seconds / 1e9 if seconds else None


def figures(run: dict[str, Any]) -> dict[str, float | None]:
    """One run's figures: the first step (call 0) and the timed ones after it."""
    calls, seconds, read = run["calls"], run["call_seconds"], run["call_read_bytes"]
    n, marks, last = len(seconds), run["rss_anon"], run["calls"][-1]
    start = marks["before"]["now"]
    return {
        "load_s": marks["loaded"]["at_s"] - marks["before"]["at_s"],
        "first_s": seconds[0],
        "step_s": statistics.median(seconds[1:]),
        "cached_mb": run["page_cache"]["cached_bytes"] / MB,
        "packed_mb": last.get("packed_bytes", 0) / MB,
        "in_place_mb": last.get("in_place_bytes", 0) / MB,
        "file_backed_mb": last.get("file_backed_bytes", 0) / MB,
        "slab_mb": last.get("slab_bytes", 0) / MB,
        "gathered_mb_step": _grew(calls, "gathered_bytes", 1, n) / (n - 1) / MB,
        "first_gather_gbps": _gather_gbps(calls, 0, 1),
        "gather_gbps": _gather_gbps(calls, 1, n),
        "first_mincore_mb": _grew(calls, "gathered_from_disk_bytes", 0, 1) / MB,
        "first_read_mb": read[0] / MB,
        "later_read_mb": sum(read[1:]) / (n - 1) / MB,
        "peak_anon_mb": (max(mark["peak"] for mark in marks.values()) - start) / MB,
        "after_anon_mb": (marks["sampled"]["now"] - start) / MB,
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratios(found: dict[Config, dict[str, Any]], config: Config) -> dict[str, float | None]:
    """``config``'s step time ÷ plain ComfyUI's (warm) and ÷ its own path's at 100 %, in one round."""
    step = {c: result["figures"]["step_s"] for c, result in found.items()}
    return {"x_plain": step[config] / step[PLAIN_WARM],
            "x_full": step[config] / step[config.full] if config.full in step else None}


def summarize(rounds: list[dict[Config, dict[str, Any]]]) -> dict[Config, dict[str, Any]]:
    """Each configuration's figures and ratios (taken within each round), median over the rounds, and the range of
    its step time; whether every latent matched plain's."""
    out = {}
    for config in rounds[0]:
        per_round = [{**found[config]["figures"], **_ratios(found, config)} for found in rounds]
        out[config] = {name: _median([figures[name] for figures in per_round]) for name in per_round[0]}
        steps = [figures["step_s"] for figures in per_round]
        out[config].update(step_min=min(steps), step_max=max(steps),
                           same_latent=all(found[config]["same_latent"] for found in rounds))
    return out


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds the machine has been busy since it booted (/proc/stat, steal included, idle and I/O wait
    not), and those of this process's children that have ended."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def run_undisturbed(run_spec: dict[str, Any], version: Version) -> tuple[dict[str, Any], int, bool]:
    """The driver's results for ``run_spec``, run again while other processes kept more than FOREIGN_CPU_LIMIT of
    a core busy meanwhile; with how many runs were repeated and whether the last was still disturbed."""
    for tries in range(1, RUN_TRIES + 1):
        (busy, ours), started = _cpu_seconds(), time.monotonic()
        run = run_in_fresh_process(run_spec, version.python, version.comfyui)
        (busy_after, ours_after), seconds = _cpu_seconds(), time.monotonic() - started
        foreign = (busy_after - busy - (ours_after - ours)) / seconds
        if foreign <= FOREIGN_CPU_LIMIT:
            return run, tries - 1, False
        log.warning("other processes kept %.0f %% of a core busy during that run (try %d of %d)", 100 * foreign,
                    tries, RUN_TRIES)
    return run, RUN_TRIES - 1, True


def run_round(version: Version, models: ModelDir, file_bytes: int, plan: list[Config], evict: str,
              folder: Path) -> dict[Config, dict[str, Any]]:
    """Every configuration once, in a fresh process each; plain's latent is the one each must match."""
    found: dict[Config, dict[str, Any]] = {}
    model_file = models.models_dir / "diffusion_models" / UNET_NAME
    for config in plan:
        latent = folder / f"{config.via}_{config.share}_{config.cold}.pt"
        warm_page_cache(model_file)
        run, repeated, disturbed = run_undisturbed(spec(config, models, file_bytes, latent, evict), version)
        found[config] = {"figures": figures(run), "latent": torch.load(latent), "versions": run["versions"],
                         "repeated": repeated, "disturbed": disturbed}
        log.info("%s, %s, %s, %s: %.3f s/step (first %.3f s)", version.name, config.path, config.budget,
                 "cold" if config.cold else "warm", found[config]["figures"]["step_s"],
                 found[config]["figures"]["first_s"])
    plain = found[PLAIN_WARM]["latent"]
    for result in found.values():
        result["same_latent"] = torch.equal(result.pop("latent"), plain)
    return found


TABLE_HEADERS = ["ComfyUI", "path", "host budget", "page cache", "file cached at start MB",
                 "packed / in place (file-backed) MB", "load s", "1st step s", "s/step (range over rounds)",
                 "× 100 %", "× plain", "gathered MB/step", "gather GB/s, 1st step / later",
                 "1st step from disk MB, mincore / read", "later steps read MB/step", "peak RssAnon − start MB",
                 "RssAnon after − start MB", "latent = plain"]


def table_row(version: str, config: Config, f: dict[str, Any], evict: str) -> list[str]:
    layout = "—" if config.via == "plain" else (
        f"{f['packed_mb']:.0f} / {f['in_place_mb']:.0f} ({f['file_backed_mb']:.0f})")
    return [version, config.path, config.budget, f"cold ({evict})" if config.cold else "warm", fmt(f["cached_mb"], 0),
            layout, fmt(f["load_s"], 1), fmt(f["first_s"], 3),
            f"{fmt(f['step_s'], 3)} ({fmt(f['step_min'], 3)}–{fmt(f['step_max'], 3)})", fmt(f["x_full"]),
            fmt(f["x_plain"]), fmt(f["gathered_mb_step"], 0),
            f"{fmt(f['first_gather_gbps'])} / {fmt(f['gather_gbps'])}",
            f"{fmt(f['first_mincore_mb'], 0)} / {fmt(f['first_read_mb'], 0)}", fmt(f["later_read_mb"], 0),
            fmt(f["peak_anon_mb"], 0), fmt(f["after_anon_mb"], 0), "yes" if f["same_latent"] else "NO"]


def table(results: dict[str, dict[Config, dict[str, Any]]], evict: str) -> str:
    return markdown_table(TABLE_HEADERS, [table_row(version, config, figures, evict)
                                          for version, found in results.items() for config, figures in found.items()])


def machine() -> str:
    """The CPU, cores, RAM, Python and the load average now."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, no GPU; Python {platform.python_version()}; "
            f"load average {os.getloadavg()[0]:.1f} when it ended")


def versions(names: str | None) -> list[Version]:
    """The ComfyUI in use here, or the named versions of dev.py (each with its own virtual environment)."""
    if names is None:
        return [Version(comfyui_version(), sys.executable, comfyui_path())]
    from dev import VERSIONS

    return [Version(name, str(VERSIONS[name].python), VERSIONS[name].comfyui) for name in names.split(",")]


def model_dir(folder: Path, smoke: bool) -> ModelDir:
    """A ComfyUI base folder whose diffusion model ``UNET_NAME`` is the benchmark's fixture."""
    source = tiny_qwen_image_file(**(SMOKE_MODEL if smoke else MODEL))
    target = folder / "models" / "diffusion_models" / UNET_NAME
    target.parent.mkdir(parents=True)
    target.symlink_to(source)
    return ModelDir(folder)


def section(measured: dict[Version, list[dict[Config, dict[str, Any]]]], evict: str, file_bytes: int, layers: int,
            seconds: float) -> str:
    """The BENCHMARKS.md section: how it was measured, the table, how to read it."""
    results = {version.name: summarize(per_round) for version, per_round in measured.items()}
    runs = [run for per_round in measured.values() for found in per_round for run in found.values()]
    rounds = len(next(iter(measured.values())))
    torch_versions = sorted({run["versions"]["torch"] for run in runs})
    cold = ("`sync; echo 1 > /proc/sys/vm/drop_caches`" if evict == "drop_caches" else
            "the file evicted with `posix_fadvise(POSIX_FADV_DONTNEED)` after an fsync "
            + ("(`--cold fadvise`)" if os.access(DROP_CACHES, os.W_OK) else "(drop_caches not writable here)"))
    return "\n\n".join([
        f"Measured by `.venv/bin/python bench/host_budget.py --versions {','.join(results)} --rounds {rounds}` on "
        f"{time.strftime('%Y-%m-%d')}, {seconds / 60:.1f} min; {machine()}; torch {', '.join(torch_versions)}; "
        f"ComfyUI {', '.join(results)} with `--cpu`.",
        f"A {file_bytes / MB:.0f} MB float32 Qwen-Image-shaped model file ({layers} blocks), every group streamed "
        f"(`stream_all`, prefetch 1), `host_memory = budget` with host_gb a share of the file; each row a fresh "
        f"process, "
        f"{STEPS - 1} timed steps after a warm-up step (64×64, euler, cfg 4, one model call a step), medians over "
        f"{rounds} round(s). Warm: the file read through just before the process starts. Cold: {cold}, after loading "
        f"and right before sampling; pages a process has mapped stay (the loader's packed groups). A run during which "
        f"other processes kept more than {FOREIGN_CPU_LIMIT:.0%} of a core busy was run again, {RUN_TRIES} tries at "
        f"most: {sum(run['repeated'] for run in runs)} repeats for {len(runs)} runs, "
        f"{sum(run['disturbed'] for run in runs)} kept disturbed.",
        table(results, evict),
        COLUMNS,
        *(reading(name, found) for name, found in results.items()),
        spread(results),
        CAVEATS,
    ])


COLUMNS = (
    "*load s*: until the loader returns (this pack's loader packs the groups within the budget there) or, on the "
    "node's path, until ComfyUI's loader and the node return (the node's groups are built as sampling starts). "
    "*1st step s*: the warm-up step's model call (building the node's groups excluded). "
    "*× 100 %*: s/step ÷ the same path's at 100 % with the same page cache, in the same round; *× plain*: ÷ plain "
    "ComfyUI's warm s/step. *gathered*, *gather GB/s*: the handle's `gathered_bytes` ÷ `gather_seconds` (the 1st "
    "step also gathers the group prefetched for the 2nd). *1st step from disk*: *mincore* is the handle's "
    "`gathered_from_disk_bytes` (pages not in the page cache as each gather began), *read* the process's "
    "`read_bytes` (/proc/self/io) during that model call: what it had read from storage, the read-ahead included "
    "(and any other file it read then). "
    "*RssAnon − start*: anonymous memory, read every 20 ms while loading and sampling, less RssAnon before loading; "
    "on the node's path it includes ComfyUI's own copy of the model, whose tensors are the groups kept in place.")

CAVEATS = (
    "What this does not show. On the CPU the device is the host: a streamed group is copied host-to-host into a "
    "slab at every step, and a group kept in place is gathered from the page cache straight into the slab on the "
    "sampling thread — no pinned staging ring, no gather worker, no overlap with compute; the GPU path is the "
    "`stream_all p1, host budget 25 %` row of `bench/gpu_benchmark.py`. Nor is the RAM smaller than the model "
    "here: the page cache keeps the whole file once read, so cold costs the first step only; where the cache "
    "cannot hold the groups kept in place, every step reads again what it dropped, at the 1st cold step's rate "
    "(`bench/host_budget_box.py` measures that, in a memory cgroup with room for half the file). "
    "That rate is this VM's virtual disk's, which its host may cache; a local disk reads at its own. Absolute CPU "
    "times on this shared 2-core VM are loose; read the ratios, taken within one round.")


def spread(results: dict[str, dict[Config, dict[str, Any]]]) -> str:
    """How far one configuration's step time moved between rounds: the noise to read the ratios against."""
    ranges = [f["step_max"] / f["step_min"] - 1 for found in results.values() for f in found.values()]
    return (f"Between rounds, one configuration's s/step moved by up to {100 * max(ranges):.0f} % (median "
            f"{100 * statistics.median(ranges):.0f} %; the range beside each s/step): read the ratios against that.")


def reading(version: str, found: dict[Config, dict[str, Any]]) -> str:
    """What this run's figures say, for the loader's smallest and largest budgets beside plain ComfyUI."""
    shares = sorted({config.share for config in found if config.via == "loader"})
    low, high = shares[0], shares[-1]
    warm, cold = found[Config("loader", low, False)], found[Config("loader", low, True)]
    other_reads = found[Config("plain", None, True)]["first_read_mb"]  # plain's weights are anonymous memory
    peaks = {config: f["peak_anon_mb"] for config, f in found.items() if not config.cold}
    return (
        f"ComfyUI {version}: warm, this pack's loader at {low:.0%} steps in {fmt(warm['step_s'], 3)} s, "
        f"{fmt(warm['x_full'])}× its step at {high:.0%}, gathering {fmt(warm['gathered_mb_step'], 0)} MB a step from "
        f"the page cache at {fmt(warm['gather_gbps'])} GB/s. Cold, its first step took {fmt(cold['first_s'], 3)} s "
        f"against {fmt(warm['first_s'], 3)} s warm, gathering at {fmt(cold['first_gather_gbps'])} GB/s; it read "
        f"{fmt(cold['first_read_mb'], 0)} MB from storage, of which {fmt(other_reads, 0)} MB were other files "
        f"(plain ComfyUI's cold first step, which reads nothing of the model, read as much) and "
        f"{fmt(cold['first_read_mb'] - other_reads, 0)} MB the {fmt(cold['in_place_mb'], 0)} MB kept in place; "
        f"mincore found {fmt(cold['first_mincore_mb'], 0)} MB of these missing as each gather began: the read-ahead "
        f"(the core's madvise WILLNEED on the groups that follow, the kernel's own on each fault) had brought in the "
        f"rest. The steps after it read {fmt(cold['later_read_mb'], 0)} MB each. Peak RssAnon growth: plain ComfyUI "
        f"{fmt(peaks[PLAIN_WARM], 0)} MB; the loader {fmt(peaks[Config('loader', high, False)], 0)} MB "
        f"at {high:.0%} and {fmt(peaks[Config('loader', low, False)], 0)} MB at {low:.0%} (its slabs, "
        f"{fmt(found[Config('loader', low, False)]['slab_mb'], 0)} MB, and the vectors it reads at once); the node "
        f"{fmt(peaks[Config('node', low, False)], 0)} MB at {low:.0%}, ComfyUI's copy of the model being what it "
        f"keeps in place.")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", help="comma-separated ComfyUI versions of dev.py (default: the one in use)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", choices=("auto", "drop_caches", "fadvise"), default="auto",
                        help="how to make the page cache cold (auto: drop_caches where writable, else fadvise)")
    parser.add_argument("--smoke", action="store_true",
                        help="a 4-block model, 25 %% only, one round, fadvise; implies --dry-run")
    parser.add_argument("--dry-run", action="store_true", help="print the section, leave BENCHMARKS.md as it is")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    evict = "fadvise" if args.smoke else cold_method(args.cold)
    rounds, plan = (1, configs((0.25,))) if args.smoke else (args.rounds, configs(SHARES))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="host-budget-") as folder:
        models = model_dir(Path(folder), args.smoke)
        file_bytes = (models.models_dir / "diffusion_models" / UNET_NAME).stat().st_size
        measured = {version: [run_round(version, models, file_bytes, plan, evict, Path(folder))
                              for _ in range(rounds)] for version in versions(args.versions)}
    layers = (SMOKE_MODEL if args.smoke else MODEL)["num_layers"]
    markdown = section(measured, evict, file_bytes, layers, time.monotonic() - started)
    publish(HEADING, markdown, write=not (args.smoke or args.dry_run))
    return 0



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
