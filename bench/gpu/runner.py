"""The parent process: runs each family in a process of its own, relays its ``RESULT`` lines as they come,
and writes the results."""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench_paths import BENCH_DIR, REPO_ROOT

from . import __doc__ as overview
from .comfyui import comfy_allocator_env
from .config import RESULT_PREFIX, BenchConfig, smoke_config
from .families import WORKERS
from .results import write_results

log = logging.getLogger("gpu_benchmark")

ENTRY = BENCH_DIR / "gpu_benchmark.py"  # what a family's process runs, with --worker
FAMILIES = ("pack", "shipped", "lora", "lora-native", "fp8", "baselines", "legacy")
# Seconds each family may take at most on a GPU, in order of importance (the last takes what is left).
FAMILY_SHARE = {"pack": 0.45, "shipped": 0.2, "lora": 0.15, "lora-native": 0.1, "fp8": 0.15, "baselines": 0.15,
                "legacy": 1.0}


def run_family(family: str, config: BenchConfig, timeout: float, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """The family's RESULT lines as they come; a timeout or a crash keeps the rows already reported."""
    command = [sys.executable, str(ENTRY), "--worker", family, "--config", json.dumps(asdict(config)), "--out", str(out)]
    log.info("family %s (at most %.0f s)", family, timeout)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)], daemon=True).start()
    found: dict[str, Any] = {"rows": [], "facts": {}, "traces": []}
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            process.kill()
            found["error"] = f"stopped after {timeout:.0f} s (rows reported before that are kept)"
            break
        if line is None:
            break
        if line.startswith(RESULT_PREFIX):
            _collect(found, json.loads(line[len(RESULT_PREFIX):]))
            print(line, end="", flush=True)
    code = process.wait()
    if code != 0 and "error" not in found:
        found["error"] = f"exit {code} (rows reported before that are kept; the worker's log is above)"
    return found


def _collect(found: dict[str, Any], message: dict[str, Any]) -> None:
    kind = message.pop("kind")
    if kind == "row":
        found["rows"].append(message)
    elif kind == "trace":
        found["traces"].append(message)
    else:
        found["facts"].update(message)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=overview.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: every row, quickly")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO_ROOT / ".artifacts" / "gpu"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all families (s)")
    parser.add_argument("--worker", choices=FAMILIES, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    if args.worker:
        raw = json.loads(args.config)
        config = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        WORKERS[args.worker](config, args.out)
        return 0

    config = smoke_config() if args.smoke else BenchConfig()
    if not args.smoke and not torch.cuda.is_available():
        log.error("no CUDA device: this benchmark needs one (use --smoke to check its code paths on the CPU)")
        return 2
    comfy_env = {} if args.smoke else comfy_allocator_env()
    started, families = time.monotonic(), {}
    for family in args.families.split(","):
        left = args.budget_s - (time.monotonic() - started)
        if left < 20:
            families[family] = {"rows": [], "facts": {}, "traces": [], "error": "skipped: the time budget is spent"}
            continue
        share = left if args.smoke else min(left, FAMILY_SHARE[family] * args.budget_s)
        env = {} if family in ("baselines", "lora-native") else comfy_env
        families[family] = run_family(family, config, share, args.out, env)
    return write_results(config, families, time.monotonic() - started, args.out)
