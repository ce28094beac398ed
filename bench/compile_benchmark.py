"""torch.compile with and without Group Offload, on the CPU, through ComfyUI's KSampler (in-process).

Three modes per model, all whole-model ComfyUI ``TorchCompileModel`` (inductor) or eager:

- ``compiled``           UNETLoader -> TorchCompileModel -> KSampler;
- ``compiled+offloaded`` UNETLoader -> TorchCompileModel -> GroupOffload (stream_all, prefetch 1) -> KSampler;
- ``eager+offloaded``    UNETLoader -> GroupOffload (stream_all, prefetch 1) -> KSampler.

Each model is timed in its own process: rounds in which the three modes take turns
(so that both pairs, compiled+offloaded ÷ compiled and compiled+offloaded ÷ eager+offloaded, are
measured side by side in one run); a step's time is the mean time of the diffusion model's calls
(cond and uncond are batched: one call per step), without loading and sampler overhead; ratios are
medians over the rounds of the per-round ratios; the rounds must compile nothing (counted).  Then the
compile time of each compiled mode, its first run minus its steady run, in fresh processes: ``cold``
with an empty inductor cache (every kernel generated and built by the C++ compiler), ``warm`` in a
second process on that cache (a restarted ComfyUI).  torch runs one intra-op thread throughout.

Prints the table, replaces the "CPU: torch.compile" section of BENCHMARKS.md (``--no-write`` to
keep it) and writes ``.artifacts/bench/compile_benchmark.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from bench_paths import REPO_ROOT
from cpu_benchmark import ForwardLog
from reporting import fmt, markdown_table, replace_section

log = logging.getLogger("compile_benchmark")

ARTIFACTS = REPO_ROOT / ".artifacts" / "bench"
COMMAND = ".venv/bin/python bench/compile_benchmark.py"
SECTION = "CPU: torch.compile"
RESULT_PREFIX = "RESULT "
OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
MODES = ("compiled", "compiled+offloaded", "eager+offloaded")


@dataclass(frozen=True)
class ModelCase:
    name: str
    layers: int
    heads: int
    head_dim: int
    size: int  # image width and height in pixels
    steps: int

    @property
    def label(self) -> str:
        return f"Qwen-Image, {self.layers} blocks, width {self.heads * self.head_dim}"


CASES = {
    "tiny": ModelCase("tiny", layers=4, heads=2, head_dim=32, size=64, steps=4),
    "small": ModelCase("small", layers=6, heads=8, head_dim=64, size=128, steps=4),
}


# --------------------------------------------------------------------------------------------
# Worker: one model, ComfyUI in this process
# --------------------------------------------------------------------------------------------

def _boot(case: ModelCase, base_dir: Path) -> str:
    from testbed.comfy_boot import boot_comfyui_in_process
    from testbed.fixture_models import make_tiny_qwen_image, populate_models, use_models_in_process

    boot_comfyui_in_process(cpu=True)
    models = populate_models(base_dir)
    path = models.models_dir / "diffusion_models" / f"compile_bench_{case.name}.safetensors"
    make_tiny_qwen_image(path, num_layers=case.layers, num_attention_heads=case.heads,
                         attention_head_dim=case.head_dim, joint_attention_dim=64)
    use_models_in_process(models)
    return path.name


def _builders(unet_name: str) -> dict[str, Callable[[], Any]]:
    from testbed.run_nodes import run_node

    def plain():
        return run_node("UNETLoader", unet_name=unet_name, weight_dtype="default").outputs[0]

    def compiled(model):
        return run_node("TorchCompileModel", model=model, backend="inductor").outputs[0]

    def offloaded(model):
        return run_node("GroupOffload", model=model, **OFFLOAD).outputs[0]

    return {"compiled": lambda: compiled(plain()),
            "compiled+offloaded": lambda: offloaded(compiled(plain())),
            "eager+offloaded": lambda: offloaded(plain())}


def _timed_run(model: Any, case: ModelCase) -> tuple[float, float, torch.Tensor]:
    """One sampling run: its wall time, the mean time of one diffusion-model call (one step), its latent."""
    from testbed.run_nodes import run_txt2img

    forwards = ForwardLog(model.model.diffusion_model, lambda: None)
    started = time.perf_counter()
    try:
        latent = run_txt2img(model, seed=3, steps=case.steps, width=case.size, height=case.size).latent
    finally:
        forwards.remove()
    return time.perf_counter() - started, statistics.mean(f.seconds for f in forwards.forwards), latent


def compile_worker(case: ModelCase, mode: str) -> dict[str, float]:
    """The first run's wall time beyond a steady run's: tracing, and building kernels the cache lacks."""
    with tempfile.TemporaryDirectory(prefix="compile_bench_") as tmp:
        model = _builders(_boot(case, Path(tmp)))[mode]()
        first = _timed_run(model, case)[0]
        steady = min(_timed_run(model, case)[0] for _ in range(2))
        return {"compile_s": first - steady}


def timing_worker(case: ModelCase, rounds: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    with tempfile.TemporaryDirectory(prefix="compile_bench_") as tmp:
        builders = _builders(_boot(case, Path(tmp)))
        models = {mode: build() for mode, build in builders.items()}
        for model in models.values():
            _timed_run(model, case)  # compiles
        frames_before = counters["frames"]["total"]
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        latents: dict[str, torch.Tensor] = {}
        for _ in range(rounds):
            for mode in MODES:
                _, step, latents[mode] = _timed_run(models[mode], case)
                seconds[mode].append(step)
        return {
            "case": asdict(case),
            "rounds": rounds,
            "step_s": seconds,
            "frames_compiled_in_rounds": counters["frames"]["total"] - frames_before,
            "bit_identical": torch.equal(latents["compiled"], latents["compiled+offloaded"]),
            "max_diff_vs_eager": float((latents["compiled+offloaded"] - latents["eager+offloaded"]).abs().max()),
        }


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def _run_worker(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{done.stderr[-6000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX))
    return json.loads(line.removeprefix(RESULT_PREFIX))


def _compile_times(name: str, mode: str) -> dict[str, float]:
    """Cold: a fresh process with an empty inductor cache; warm: another fresh process on that cache."""
    with tempfile.TemporaryDirectory(prefix="compile_bench_inductor_") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        args = ("--worker", "compile", "--model", name, "--mode", mode)
        return {run: _run_worker(*args, env=env)["compile_s"] for run in ("cold", "warm")}


def _median_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def summarize(result: dict[str, Any]) -> list[object]:
    step = result["step_s"]
    compiled_offloaded = step["compiled+offloaded"]
    return [
        ModelCase(**result["case"]).label,
        *(fmt(statistics.median(step[mode]) * 1e3, 1) for mode in MODES),
        fmt(_median_ratio(compiled_offloaded, step["compiled"])),
        fmt(_median_ratio(compiled_offloaded, step["eager+offloaded"])),
        " / ".join(fmt(result["compile_s"]["compiled"][k], 1) for k in ("cold", "warm")),
        " / ".join(fmt(result["compile_s"]["compiled+offloaded"][k], 1) for k in ("cold", "warm")),
        "yes" if result["bit_identical"] else "no",
        result["frames_compiled_in_rounds"],
    ]


HEADERS = ["model", "compiled ms/step", "compiled+offloaded ms/step", "eager+offloaded ms/step",
           "compiled+offloaded ÷ compiled", "compiled+offloaded ÷ eager+offloaded",
           "compile s, compiled (cold / warm)", "compile s, compiled+offloaded (cold / warm)",
           "latent bit-identical to compiled", "frames compiled once warm"]


def section(results: dict[str, dict[str, Any]], command: str, elapsed: float) -> str:
    load = os.getloadavg()[0]
    first = next(iter(results.values()))
    return "\n\n".join([
        f"Measured by `{command}` on {datetime.date.today()}, {elapsed / 60:.1f} min; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (one intra-op thread), Python {platform.python_version()}, torch {torch.__version__}; load average "
        f"{load:.1f} when it ended. ComfyUI runs with `--cpu`: inductor generates C++ kernels, and every offload "
        f"copy is host-to-host.",
        f"Whole-model `TorchCompileModel` (inductor), Group Offload with `stream_all`, prefetch 1; euler, CFG 4, "
        f"{first['case']['steps']} steps per run, cond and uncond batched (one diffusion-model call per step, timed "
        f"from its entry to its exit); {first['rounds']} rounds in which the three modes take turns; ratios are "
        f"medians of the per-round ratios.",
        markdown_table(HEADERS, [summarize(r) for r in results.values()]),
        "Compile time is a compiled mode's first run minus its steady run, each in a fresh process: *cold* with "
        "an empty inductor cache, *warm* on the cache the cold run filled (a restarted ComfyUI). *frames compiled once "
        "warm* counts what torch.compile compiled during the timed rounds (torch._dynamo's frame counter). "
        "On a CPU every streamed group is copied host-to-host at every step, and compiling cannot shorten a "
        "copy: compiled+offloaded ÷ compiled is that copy time, not a cost of compiling; compiled+offloaded ÷ "
        "eager+offloaded is what compiling gains on the compute. No GPU figure stands behind these ratios.",
    ])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per model (default 5)")
    parser.add_argument("--no-write", action="store_true", help=f"do not rewrite the {SECTION!r} section of BENCHMARKS.md")
    parser.add_argument("--worker", choices=("timing", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=tuple(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # steadier on a shared machine; the same for every mode
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.worker:
        case = CASES[args.model]
        result = timing_worker(case, args.rounds) if args.worker == "timing" else compile_worker(case, args.mode)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    started = time.perf_counter()
    results = {}
    for name in args.models.split(","):
        log.info("measuring %s", CASES[name].label)
        results[name] = _run_worker("--worker", "timing", "--model", name, "--rounds", str(args.rounds))
        results[name]["compile_s"] = {mode: _compile_times(name, mode) for mode in ("compiled", "compiled+offloaded")}
    elapsed = time.perf_counter() - started
    text = section(results, " ".join([COMMAND, *argv]), elapsed)
    print(text)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "compile_benchmark.json").write_text(json.dumps({"results": results, "seconds": elapsed}, indent=1))
    if not args.no_write:
        replace_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
