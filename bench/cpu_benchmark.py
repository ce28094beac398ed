"""CPU benchmark: ComfyUI's own KSampler, in-process, with and without this pack (``python3 dev.py bench``).

Two models: the full-width Qwen-Image with a few real blocks (``--blocks``, 3 by default) and the
tiny test model.  ComfyUI on the CPU keeps the bf16 file's weights in float32, so a full-width block
is 1.36 GB in memory (680 MB in the file).  Modes, interleaved in rounds in one process per model:

- ``plain``       UNETLoader -> KSampler;
- ``copy-back``   the diffusers ``use_stream=False`` baseline (``bench/copy_back.py``: each weight
                  copied in, then copied back into fresh host memory, per block); one round only,
                  it is by far the slowest;
- ``pack p0/p1``  UNETLoader -> GroupOffload (stream_all, prefetch 0 / 1) -> KSampler;
- ``pack ⅓, ⅔``   the same with ``residency = budget`` holding ⅓ / ⅔ of the groups.

Plain runs between every two modes.  Per mode, from the forwards after the first (the steady
state): step time as a ratio to the plain runs on either side of it (median over its runs), the
ledger's bytes and copies per step and hook µs per group, and the peak host RSS while sampling.
A second process per model loads through ``GroupOffloadLoader`` to compare the peak RSS while
*loading* with UNETLoader's.  RSS figures are net of the process's RSS before the model was loaded,
divided by the model's bytes in memory.
Then ``bench/hook_overhead.py`` measures the hook overhead on a plain torch model.

The result tables (``bench/cpu_report.py``) are printed and replace the "CPU" section of BENCHMARKS.md (``--no-write`` to
keep it); the raw figures go to ``.artifacts/bench/cpu_benchmark.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hook_overhead
from bench_paths import REPO_ROOT
from copy_back import CopyBackOffload
from cost_model import pass_seconds
from testbed.host_memory import peak_rss_bytes, reset_peak, rss_bytes
from offload_core.mirror import ALIGNMENT
from cpu_report import cpu_section
from reporting import replace_section

log = logging.getLogger("cpu_benchmark")

ARTIFACTS = REPO_ROOT / ".artifacts" / "bench"
COMMAND = "python3 dev.py bench"
CFG = 4.0
NODE_GB = 1024**3  # the GroupOffload node's resident_gb unit
RESULT_PREFIX = "RESULT "
LEDGER_FIELDS = ("bytes_h2d", "bytes_d2h", "copies_h2d", "copies_d2h", "hook_seconds", "hook_calls", "sync_onloads")


@dataclass(frozen=True)
class ModelCase:
    name: str
    layers: int
    size: int  # image width and height in pixels
    text_tokens: int
    steps: int
    rounds: int

    @property
    def full_width(self) -> bool:
        return self.name == "full_width"

    @property
    def joint_dim(self) -> int:
        return 3584 if self.full_width else 64

    @property
    def label(self) -> str:
        return f"full-width Qwen-Image, {self.layers} blocks" if self.full_width else f"tiny Qwen-Image, {self.layers} blocks"


@dataclass(frozen=True)
class Mode:
    name: str
    label: str
    prefetch: int | None = None  # None: not this pack
    resident_share: float = 0.0  # of the groups, with residency = budget; 0 = stream_all
    copy_back: bool = False
    max_rounds: int | None = None


MODES = (
    Mode("plain", "plain (no offload)"),
    Mode("copy_back", "copy-back baseline", copy_back=True, max_rounds=1),
    Mode("p0", "pack, stream_all, prefetch 0", prefetch=0),
    Mode("p1", "pack, stream_all, prefetch 1", prefetch=1),
    Mode("budget_third", "pack, budget ⅓ resident, prefetch 1", prefetch=1, resident_share=1 / 3),
    Mode("budget_two_thirds", "pack, budget ⅔ resident, prefetch 1", prefetch=1, resident_share=2 / 3),
)
MODES_BY_NAME = {m.name: m for m in MODES}


def model_cases(blocks: int, quick: bool) -> dict[str, ModelCase]:
    return {
        "full_width": ModelCase("full_width", blocks, 32, 4, steps=3, rounds=1 if quick else 2),
        "tiny": ModelCase("tiny", 6, 64, 8, steps=4 if quick else 6, rounds=2 if quick else 3),
    }


# --------------------------------------------------------------------------------------------
# Worker side (one process per model and loader): ComfyUI in-process
# --------------------------------------------------------------------------------------------

@dataclass
class Forward:
    seconds: float
    batch: int
    ledger: dict[str, float]  # deltas over this forward


class ForwardLog:
    """Times every call of the diffusion model and the ledger's deltas over it."""

    def __init__(self, diffusion_model: nn.Module, ledger_of: Callable[[], Any]) -> None:
        self.forwards: list[Forward] = []
        self._ledger_of = ledger_of
        self._start: tuple[float, int, dict[str, float]] | None = None
        self._hooks = [diffusion_model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       diffusion_model.register_forward_hook(self._post)]

    def _snapshot(self) -> dict[str, float]:
        ledger = self._ledger_of()
        return {f: getattr(ledger, f) for f in LEDGER_FIELDS} if ledger is not None else {}

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["x"]
        self._start = (time.perf_counter(), x.shape[0], self._snapshot())

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        start, batch, before = self._start
        after = self._snapshot()
        self.forwards.append(Forward(time.perf_counter() - start, batch, {k: after[k] - before[k] for k in after}))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _model_file(case: ModelCase) -> Path:
    from testbed.fixture_models import full_width_qwen_image_file, tiny_qwen_image_file

    return full_width_qwen_image_file(case.layers) if case.full_width else tiny_qwen_image_file(case.layers)


def _boot(case: ModelCase, base_dir: Path) -> str:
    """ComfyUI in this process, finding the case's model file as ``unet_name``; returns that name."""
    from testbed.comfy_boot import boot_comfyui_in_process
    from testbed.fixture_models import populate_models, use_models_in_process

    path = _model_file(case)
    boot_comfyui_in_process(cpu=True)
    models = populate_models(base_dir)
    link = models.models_dir / "diffusion_models" / f"bench_{case.name}_{case.layers}.safetensors"
    link.symlink_to(path)
    use_models_in_process(models)
    return link.name


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _group_bytes(block: nn.Module) -> int:
    """A block's size in the pack's packed mirror (each tensor aligned)."""
    return sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in (*block.parameters(), *block.buffers()))


def _conditioning(case: ModelCase, seed: int) -> list:
    from testbed.run_nodes import make_test_conditioning

    return make_test_conditioning(seed, case.text_tokens, case.joint_dim)


def _sample(model: Any, case: ModelCase, steps: int) -> None:
    from testbed.run_nodes import run_txt2img

    run_txt2img(model, steps=steps, cfg=CFG, width=case.size, height=case.size,
                positive=_conditioning(case, 1), negative=_conditioning(case, 2))


def _load(loader: str, unet_name: str, **inputs: Any) -> tuple[Any, dict[str, float]]:
    """Run a loader node; the model and the RSS (net of before) while and after loading."""
    from testbed.run_nodes import run_node

    gc.collect()
    before = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    (model,) = run_node(loader, unet_name=unet_name, weight_dtype="default", **inputs).outputs
    seconds = time.perf_counter() - start
    model_bytes = _module_bytes(model.model.diffusion_model)
    return model, {"loader": loader, "seconds": seconds, "model_bytes": model_bytes, "base_rss": before,
                   "peak_rss": peak_rss_bytes() - before, "after_rss": rss_bytes() - before}


def _unload_all() -> None:
    import comfy.model_management as mm

    mm.unload_all_models()  # detach(unpatch_all=True): the pack's handle is removed
    gc.collect()


def _prepare(plain: Any, mode: Mode, group_bytes: int) -> tuple[Any, Callable[[], Any], Callable[[], None]]:
    """The MODEL to sample for ``mode``, where its ledger is, and how to undo the mode."""
    from testbed.run_nodes import run_node

    blocks = plain.model.diffusion_model.transformer_blocks
    if mode.copy_back:
        baseline = CopyBackOffload(blocks, "cpu")
        return plain, lambda: baseline.ledger, baseline.remove
    if mode.prefetch is None:
        return plain, lambda: None, lambda: None
    resident = round(mode.resident_share * len(blocks))
    (offloaded,) = run_node("GroupOffload", model=plain, blocks_per_group=1, prefetch=mode.prefetch,
                            residency="budget" if resident else "stream_all",
                            resident_gb=(resident + 0.5) * group_bytes / NODE_GB if resident else 0.0).outputs
    return offloaded, lambda: offloaded.current_handle().ledger, _unload_all


def _run_mode(plain: Any, mode: Mode, case: ModelCase, group_bytes: int, base_rss: int) -> dict[str, Any]:
    _unload_all()
    diffusion_model = plain.model.diffusion_model
    hooked = [i for i, b in enumerate(diffusion_model.transformer_blocks)
              if b._forward_pre_hooks or b._forward_hooks or "forward" in b.__dict__]
    if hooked:
        raise RuntimeError(f"blocks {hooked} are still hooked or wrapped before mode {mode.name}: "
                           "a handle outlived its patcher")
    model, ledger_of, undo = _prepare(plain, mode, group_bytes)
    forward_log = ForwardLog(diffusion_model, ledger_of)
    reset_peak()
    try:
        with torch.inference_mode():
            _sample(model, case, case.steps)
        peak = peak_rss_bytes() - base_rss
        handle = model.current_handle() if mode.prefetch is not None else None
        layout = handle.stats() if handle is not None else {}
    finally:
        forward_log.remove()
        undo()
    return {"mode": mode.name, "peak_rss": peak, "forwards": [asdict(f) for f in forward_log.forwards],
            "groups": layout.get("groups"), "resident_groups": layout.get("resident_groups"),
            "device_side_bytes": _device_side_bytes(mode, layout, group_bytes)}


def _device_side_bytes(mode: Mode, layout: dict[str, Any], group_bytes: int) -> int:
    """What a GPU would hold in VRAM but the CPU run holds in host memory: slabs and resident copies,
    or the one block the copy-back baseline has "on the device" at a time."""
    if mode.copy_back:
        return group_bytes
    return layout.get("slab_bytes", 0) + layout.get("resident_bytes", 0)


def schedule(modes: list[Mode], rounds: int) -> list[tuple[int, Mode]]:
    """(round, mode) in order: plain before every other mode and again at the end of each round.

    Each mode is then compared with the plain runs on either side of it, which cancels slow drifts
    of the machine's load; the other modes rotate from round to round.
    """
    plain = MODES_BY_NAME["plain"]
    others = [m for m in modes if m is not plain]
    order = []
    for r in range(rounds):
        shift = r % len(others) if others else 0
        for mode in others[shift:] + others[:shift]:
            if mode.max_rounds is None or r < mode.max_rounds:
                order += [(r, plain), (r, mode)]
        order.append((r, plain))
    return order


def host_copy_bandwidth(nbytes: int = 256 * 2**20) -> dict[str, float]:
    """GB/s of a host copy into existing memory (the pack's slabs) and into fresh memory (copy-back)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source).fill_(0)

    def best(fn: Callable[[], object]) -> float:
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return nbytes / min(seconds) / 1e9

    return {"existing_gbps": best(lambda: target.copy_(source)), "fresh_gbps": best(lambda: source.clone())}


def timing_worker(case: ModelCase, mode_names: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="group-offload-bench-") as base:
        unet_name = _boot(case, Path(base))
        plain, load = _load("UNETLoader", unet_name)
        blocks = plain.model.diffusion_model.transformer_blocks
        group_bytes = _group_bytes(blocks[0])
        bandwidth = host_copy_bandwidth()
        runs = []
        for round_index, mode in schedule([MODES_BY_NAME[n] for n in mode_names], case.rounds):
            log.info("%s, round %d: %s", case.name, round_index + 1, mode.label)
            runs.append({"round": round_index, **_run_mode(plain, mode, case, group_bytes, load["base_rss"])})
    return {"case": asdict(case), "load": load, "group_bytes": group_bytes, "blocks": len(blocks),
            "bandwidth": bandwidth, "runs": runs}


def loader_worker(case: ModelCase) -> dict[str, Any]:
    """Load through GroupOffloadLoader (stream_all, prefetch 1), then sample once, for the peak RSS."""
    with tempfile.TemporaryDirectory(prefix="group-offload-bench-") as base:
        unet_name = _boot(case, Path(base))
        model, load = _load("GroupOffloadLoader", unet_name, blocks_per_group=1, prefetch=1,
                            residency="stream_all", resident_gb=0.0)
        reset_peak()
        with torch.inference_mode():
            _sample(model, case, steps=2)
        load["sampling_peak_rss"] = peak_rss_bytes() - load["base_rss"]
        load["sampling_device_side_bytes"] = _device_side_bytes(MODES_BY_NAME["p1"], model.current_handle().stats(), 0)
    return {"case": asdict(case), "load": load}


# --------------------------------------------------------------------------------------------
# Parent side: workers, aggregation, tables
# --------------------------------------------------------------------------------------------

def _run_worker(kind: str, case_name: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", kind, "--model", case_name, "--blocks", str(args.blocks),
               "--modes", ",".join(args.modes)] + (["--quick"] if args.quick else [])
    log.info("worker: %s", " ".join(command[1:]))
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker {kind} {case_name} failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def _steady(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run["forwards"][1:]


def _per_step(forwards: list[dict[str, Any]], field: str) -> float | None:
    values = [f["ledger"][field] for f in forwards if field in f["ledger"]]
    return sum(values) / len(forwards) if values and forwards else None


def _bracket_ratios(runs: list[dict[str, Any]]) -> dict[int, float]:
    """Run index -> its steady step time ÷ the mean of the plain runs just before and after it."""
    step = [statistics.median(f["seconds"] for f in _steady(r)) for r in runs]
    ratios = {}
    for i, run in enumerate(runs):
        before = next((step[j] for j in range(i - 1, -1, -1) if runs[j]["mode"] == "plain"), None)
        after = next((step[j] for j in range(i + 1, len(runs)) if runs[j]["mode"] == "plain"), None)
        neighbours = [t for t in (before, after) if t is not None]
        if run["mode"] != "plain" and neighbours:
            ratios[i] = step[i] / statistics.mean(neighbours)
    return ratios


def summarize(timing: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode: medians over its runs of the steady-state figures."""
    runs, model_bytes = timing["runs"], timing["load"]["model_bytes"]
    ratios = _bracket_ratios(runs)
    plain_s = statistics.median(statistics.median(f["seconds"] for f in _steady(r)) for r in runs if r["mode"] == "plain")
    rows = []
    for mode in MODES:
        indices = [i for i, r in enumerate(runs) if r["mode"] == mode.name]
        if not indices:
            continue
        mine = [runs[i] for i in indices]
        steady = _steady(mine[0])
        hook_calls = sum(f["ledger"].get("hook_calls", 0) for r in mine for f in _steady(r))
        hook_s = sum(f["ledger"].get("hook_seconds", 0.0) for r in mine for f in _steady(r))
        groups, resident = mine[0]["groups"], mine[0]["resident_groups"]
        peak = max(mine, key=lambda r: r["peak_rss"])
        row = {
            "mode": mode.name, "label": mode.label, "runs": len(mine), "steps": sum(len(_steady(r)) for r in mine),
            "batch": steady[0]["batch"] if steady else None,
            "step_s": statistics.median(statistics.median(f["seconds"] for f in _steady(r)) for r in mine),
            "ratio": 1.0 if mode.name == "plain" else statistics.median(ratios[i] for i in indices if i in ratios),
            "h2d_per_step": _per_step(steady, "bytes_h2d"), "d2h_per_step": _per_step(steady, "bytes_d2h"),
            "copies_h2d_per_step": _per_step(steady, "copies_h2d"), "copies_d2h_per_step": _per_step(steady, "copies_d2h"),
            "sync_onloads_per_step": _per_step(steady, "sync_onloads"),
            "streamed_groups": None if groups is None else groups - resident, "groups": groups,
            "hook_us_per_group": 1e6 * hook_s / hook_calls if hook_calls else None,
            "peak_rss_ratio": peak["peak_rss"] / model_bytes,
            "host_rss_ratio": (peak["peak_rss"] - peak["device_side_bytes"]) / model_bytes,
        }
        row["model_ratio"] = _cost_model_ratio(row, plain_s, timing["bandwidth"])
        rows.append(row)
    return rows


def _cost_model_ratio(row: dict[str, Any], plain: float, bandwidth: dict[str, float]) -> float | None:
    """The cost model's step time ÷ plain, with the CPU's measured copy rates (no overlap on a CPU)."""
    if row["h2d_per_step"] is None:
        return None
    h2d_gbps = bandwidth["fresh_gbps"] if row["mode"] == "copy_back" else bandwidth["existing_gbps"]
    seconds = pass_seconds(plain, row["h2d_per_step"], h2d_gbps, row["d2h_per_step"] or 0.0, bandwidth["fresh_gbps"])
    return seconds / plain


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="full-width blocks (1.36 GB each in float32; default 3)")
    parser.add_argument("--models", default="full_width,tiny", help="comma-separated: full_width, tiny")
    parser.add_argument("--modes", default=",".join(m.name for m in MODES), type=lambda s: s.split(","),
                        help="comma-separated subset of: " + ", ".join(m.name for m in MODES))
    parser.add_argument("--quick", action="store_true", help="fewer rounds and forwards")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite the CPU section of BENCHMARKS.md")
    parser.add_argument("--worker", choices=("timing", "loader"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _configure_logging()
    cases = model_cases(args.blocks, args.quick)

    if args.worker:
        case = cases[args.model]
        result = timing_worker(case, args.modes) if args.worker == "timing" else loader_worker(case)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    started = time.perf_counter()
    results = {}
    for name in args.models.split(","):
        timing = _run_worker("timing", name, args)
        loader = _run_worker("loader", name, args)
        results[name] = {"label": cases[name].label, "case": timing["case"], "timing": timing,
                         "loads": [timing["load"], loader["load"]]}
    for result in results.values():
        result["rows"] = summarize(result["timing"])
    micro, profile = hook_overhead.run_all(args.quick, profile=True)
    elapsed = time.perf_counter() - started

    command = " ".join([COMMAND, *argv])
    section = cpu_section(results, micro, profile, command, elapsed, CFG)
    print(section)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "cpu_benchmark.json").write_text(json.dumps(
        {"results": results, "hook_overhead": micro, "seconds": elapsed}, indent=1))
    if not args.no_write:
        replace_section("CPU", section)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
