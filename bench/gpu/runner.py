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
from .config import RESULT_PREFIX, ROWS, BenchConfig, config_from_json, smoke_config
from .families import COMPILE_SYSTEMS, TEXT_ENCODER_SYSTEMS, WORKERS
from .families.text_encoder import remove_files
from .results import write_results

log = logging.getLogger("gpu_benchmark")

ENTRY = BENCH_DIR / "gpu_benchmark.py"  # what a family's process runs, with --worker
# The order of a GPU call: what users gain first (issue 33, then the text encoder of issue 46), then the families
# measured before.
FAMILIES = ("shipped", "auto", "fp8", "gguf", *COMPILE_SYSTEMS, "box", *TEXT_ENCODER_SYSTEMS, "legacy",
            "pack", "lora", "lora-native", "baselines")
# names that stand for several families in --families
GROUPS = {"compile": COMPILE_SYSTEMS, "text_encoder": TEXT_ENCODER_SYSTEMS}
# Seconds each family may take at most on a GPU (the budget left caps it too); where the families asked for add up
# to less than --budget-s, their caps are stretched to fill it, so that a second call of fewer families (e.g.
# --families compile) gives each more. The other families ask for 755 s, more than the 450 run.sh leaves them (a
# call reaches those it can, in order; BENCH_ARGS picks the rest); the text encoder's 375 s (te-dynamic writes the 15.5 GB file, te-legacy where Dynamic VRAM did not
# start; te-lowvram encodes on the CPU) take a call of their own (BENCH_ARGS="--families text_encoder"), stretched
# to 450 s there.
FAMILY_SECONDS = {"shipped": 50, "auto": 35, "fp8": 40, "gguf": 90, **dict.fromkeys(COMPILE_SYSTEMS, 25),
                  "box": 85, **dict.fromkeys(TEXT_ENCODER_SYSTEMS, 45), "te-dynamic": 75,
                  "te-legacy": 60, "te-lowvram": 60,
                  "legacy": 30, "pack": 150, "lora": 50, "lora-native": 40, "baselines": 60}


class FamilyRun:
    """A family's process and what it reported: its RESULT lines as they come, relayed at once. A row that
    passes its limit (from its ``start`` line) or whose process dies gets its RESULT line here, and the family
    starts again after it while its time lasts; a row never hides the others."""

    def __init__(self, family: str, config: BenchConfig, out: Path, env: dict[str, str]) -> None:
        self.family, self.config, self.out, self.env = family, config, out, env
        self.found: dict[str, Any] = {"rows": [], "facts": {}, "traces": []}
        self.open_row: dict[str, Any] | None = None
        self.rows_begun = 0

    def run(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        log.info("family %s (at most %.0f s)", self.family, timeout)
        while True:
            ended = self._one_process(deadline)
            if ended is None:  # the family's own end
                return self.found
            if self.open_row is None:  # outside any row: its setup failed, or it ended between rows
                self.found["error"] = f"{ended} outside a row (the rows reported before that are kept)"
                return self.found
            self._close_open_row(ended)
            if time.monotonic() > deadline - 10:
                self.found["error"] = f"{ended}; its time ({timeout:.0f} s) is spent, the rows after it did not run"
                return self.found
            log.info("family %s: starting again after row %d", self.family, self.rows_begun)

    def _one_process(self, deadline: float) -> str | None:
        """Run the family's process from row ``rows_begun``; None when it ended by itself with exit 0, else why
        it ended."""
        command = [sys.executable, str(ENTRY), "--worker", self.family, "--config", json.dumps(asdict(self.config)),
                   "--out", str(self.out), "--skip", str(self.rows_begun)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                         daemon=True).start()
        while True:
            row_deadline = self.open_row["deadline"] if self.open_row else deadline
            try:
                line = lines.get(timeout=max(0.1, min(deadline, row_deadline) - time.monotonic()))
            except queue.Empty:
                process.kill()
                process.wait()
                if self.open_row is not None and row_deadline <= deadline:
                    return f"over its {self.open_row['row']['limit_s']:.0f} s limit"
                return "the family's time ran out"
            if line is None:
                break
            if line.startswith(RESULT_PREFIX):
                print(line, end="", flush=True)
                self._collect(json.loads(line[len(RESULT_PREFIX):]))
        code = process.wait()
        if code == 0 and self.open_row is None:
            return None
        return f"its process ended with exit {code}" + (" (killed: out of host memory?)" if code == -9 else "")

    def _collect(self, message: dict[str, Any]) -> None:
        kind = message.pop("kind")
        if kind == "start":
            self.open_row = {"row": message, "deadline": time.monotonic() + message["limit_s"]}
            self.rows_begun = message["index"] + 1
        elif kind == "row":
            self.open_row = None
            self.found["rows"].append(message)
        elif kind == "trace":
            self.found["traces"].append(message)
        else:
            self.found["facts"].update(message)

    def _close_open_row(self, why: str) -> None:
        """The RESULT line of the row that was running when its process ended or was stopped."""
        row = {**self.open_row["row"], "skipped": f"failed: {why} (the worker's log is above)"}
        self.open_row = None
        print(RESULT_PREFIX + json.dumps({"kind": "row", **row}), flush=True)
        self.found["rows"].append(row)


def family_names(requested: str) -> list[str]:
    """``--families`` with each group name (``compile``) replaced by its families."""
    names = [name for part in requested.split(",") for name in GROUPS.get(part, (part,))]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {', '.join((*FAMILIES, *GROUPS))}")
    return names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=overview.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: every row, quickly")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated, in order, of " + ", ".join((*FAMILIES, *GROUPS)))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO_ROOT / ".artifacts" / "gpu"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all families (s)")
    parser.add_argument("--worker", choices=FAMILIES, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    if args.worker:
        config = config_from_json(json.loads(args.config))
        ROWS.skip = args.skip
        WORKERS[args.worker](config, args.out)
        return 0

    config = smoke_config() if args.smoke else BenchConfig()
    if not args.smoke and not torch.cuda.is_available():
        log.error("no CUDA device: this benchmark needs one (use --smoke to check its code paths on the CPU)")
        return 2
    comfy_env = {} if args.smoke else comfy_allocator_env()
    started, families, names = time.monotonic(), {}, family_names(args.families)
    status = 0
    stretch = max(1.0, args.budget_s / sum(FAMILY_SECONDS[name] for name in names))
    for family in names:
        left = args.budget_s - (time.monotonic() - started)
        if left < 20:
            families[family] = {"rows": [], "facts": {}, "traces": [], "error": "skipped: the time budget is spent"}
        else:
            share = left if args.smoke else min(left, FAMILY_SECONDS[family] * stretch)
            # the native allocator's rows clear the variable: a caller's own setting must not leak into them
            native = {"PYTORCH_CUDA_ALLOC_CONF": ""}
            env = native if family in ("baselines", "lora-native") else comfy_env
            families[family] = FamilyRun(family, config, args.out, env).run(share)
        # after every family, so that an outer timeout (the GPU kit's) loses no finished family's table
        status = write_results(config, families, time.monotonic() - started, args.out)
    remove_files(config)
    print((args.out / "gpu_results.md").read_text(), end="")
    return status
