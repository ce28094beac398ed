"""One row: a sampling run through ComfyUI's sampler at the row's cap, timed per step, with what the row
streamed read from this pack's ledger (or estimated for ComfyUI's own rows); and the rows every family
builds from it, this pack's node and ComfyUI's own."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from testbed.host_memory import peak_rss_bytes, reset_peak

from .balloon import Balloon
from .config import ROWS, BenchConfig, Row, cap_label, emit
from .timing import CallCounter, RowOverTime, StepClock, StepProfile

log = logging.getLogger("gpu_benchmark")

OFFLOAD_ROWS = (("auto", {"residency": "auto", "prefetch": 1}),
                ("stream_all p1", {"residency": "stream_all", "prefetch": 1}),
                ("stream_all p2", {"residency": "stream_all", "prefetch": 2}))
PROFILED_MODE = "stream_all p1"  # at the smallest cap


def conditioning(config: BenchConfig, seed: int) -> list:
    cond = torch.randn((1, config.text_tokens, config.joint_dim), generator=torch.Generator().manual_seed(seed))
    return [[cond, {"pooled_output": None}]]


class Sampling:
    """One sampling run of 1 + ``config.steps`` steps through ``comfy.sample.sample`` (KSampler's path), timed
    per step: the warm-up (which includes the load) then the timed steps, the model calls and the bytes this
    process read from storage over the timed steps."""

    def __init__(self, model: Any, config: BenchConfig, at_step: dict[int, Callable[[], None]] | None = None) -> None:
        self.model, self.config = model, config
        self.at_step = dict(at_step or {})
        self.read_from = 0
        first = self.at_step.get(0)

        def after_warmup() -> None:
            handle = offload_handle(model)  # built at the first load
            if handle is not None:
                handle.reset_stats()
            self.counter.calls, self.read_from = 0, io_read_bytes()
            if first is not None:
                first()

        self.at_step[0] = after_warmup
        self.counter = CallCounter(model)
        self.clock = StepClock(config.device, self.at_step, config.row_limit_s)
        self.stopped = ""

    def run(self, seed: int = 0) -> "Sampling":
        import comfy.sample

        config = self.config
        latent = torch.zeros((1, 16, config.height // 8, config.width // 8))
        latent = comfy.sample.fix_empty_latent_channels(self.model, latent)
        noise = comfy.sample.prepare_noise(latent, seed)
        try:
            with torch.inference_mode():
                comfy.sample.sample(self.model, noise, 1 + config.steps, 4.0, "euler", "simple",
                                    conditioning(config, 1), conditioning(config, 2), latent, denoise=1.0,
                                    callback=self.clock, disable_pbar=True, seed=seed)
        except RowOverTime:
            self.stopped = (f"stopped past the row's {config.row_limit_s:.0f} s after "
                            f"{len(self.clock.steps) - 1} timed step(s)")
        finally:
            self.counter.remove()
        return self

    def fill(self, row: Row) -> None:
        """The row's step times, calls and bytes from this run."""
        import comfy.model_management as mm

        steps = self.clock.steps
        row.first_step_s, row.step_s = steps[0], steps[1:]
        row.calls_per_step = self.counter.calls / len(row.step_s)
        row.read_bytes = (io_read_bytes() - self.read_from) / len(row.step_s)
        row.peak_rss_bytes = peak_rss_bytes()
        row.comfy_pinned_bytes = getattr(mm, "TOTAL_PINNED_MEMORY", None)
        if self.stopped:
            row.note = self.stopped
        _read_loaded(row, self.model, offload_handle(self.model), len(row.step_s))


def sample_row(row: Row, model: Any, config: BenchConfig, balloon: Balloon, out: Path | None = None) -> Row:
    """Sample ``model`` at the row's cap and fill the row; with ``out``, the first timed step is traced."""
    if not ROWS.begin(row, config):
        return row
    profile = StepProfile(config, out, trace_name(row)) if out is not None else None
    try:
        balloon.set_cap(row.cap_bytes)
        reset_peak()
        Sampling(model, config, {0: profile.start, 1: profile.stop} if profile else None).run().fill(row)
    except torch.cuda.OutOfMemoryError as error:
        row.skipped = f"out of memory: {str(error).splitlines()[0][:160]}"
    end_row(row)
    if profile is not None and not row.skipped:
        emit("trace", {"family": row.family, "mode": row.mode, "cap_bytes": row.cap_bytes, **profile.write()})
    return row


def end_row(row: Row) -> None:
    """Log the row and send its RESULT line."""
    first = "" if row.first_step_s is None else f" (first {row.first_step_s:.1f} s)"  # a bare call has no warm-up
    log.info("%s %s, cap %s: %s", row.system, row.mode, cap_label(row.cap_bytes),
             row.skipped or f"{row.seconds:.3f} s/step{first}")
    emit("row", asdict(row))


def trace_name(row: Row) -> str:
    return "step_trace_" + re.sub(r"[^a-z0-9]+", "_", f"{row.family} {row.mode}".lower()).strip("_") + ".json.gz"


def io_read_bytes() -> int:
    """What this process (all its threads, the kernel's read-ahead included) has had read from storage so far
    (``read_bytes`` of /proc/self/io); 0 where there is no such file."""
    path = Path("/proc/self/io")
    if not path.exists():
        return 0
    return int(dict(line.split(": ") for line in path.read_text().splitlines())["read_bytes"])


def offload_handle(model: Any) -> Any:
    """This pack's handle on the model's blocks, or ``None`` for a model without offloading."""
    current = getattr(model, "current_handle", None)
    return current() if current is not None else None


def _read_loaded(row: Row, model: Any, handle: Any, steps: int) -> None:
    """Streamed bytes per step: the ledger's for this pack; for ComfyUI's rows, the weights it left
    off the card times the model calls (what its lowvram casts copy per call: an estimate)."""
    if handle is not None:
        stats = handle.stats()
        row.streamed_bytes = stats["bytes_h2d"] / steps
        row.d2h_bytes = stats["bytes_d2h"] / steps
        row.copies = stats["copies_h2d"] / steps
        row.compute_wait_ms = stats["compute_wait_ms"] / steps
        row.resident_groups = stats["resident_groups"]
        row.pinned_bytes = stats["pinned_bytes"]
        if stats["in_place_bytes"]:
            row.note = _gather_note(stats, steps)
        return
    off_card = max(0, model.model_size() - model.loaded_size())
    row.streamed_bytes = off_card * (row.calls_per_step or 1)
    row.d2h_bytes = 0.0
    if off_card:
        row.note = (row.note + " " if row.note else "") + "streamed bytes estimated: weights off the card × calls"


def _gather_note(stats: dict[str, Any], steps: int) -> str:
    """What a host budget left in place and what gathering it cost (issue 23)."""
    rate = stats["gathered_bytes"] / stats["gather_seconds"] / 1e9 if stats["gather_seconds"] else 0.0
    return (f"packed {stats['packed_bytes'] / 1e9:.1f} GB, in place {stats['in_place_bytes'] / 1e9:.1f} GB "
            f"({stats['file_backed_bytes'] / 1e9:.1f} file-backed); gathered {stats['gathered_bytes'] / steps / 1e9:.1f} "
            f"GB/step at {rate:.1f} GB/s, {stats['gathered_from_disk_bytes'] / steps / 1e9:.1f} GB/step from disk")


def offload_node(plain: Any, settings: dict[str, Any]) -> Any:
    """This pack's node on ``plain``, as a user wires it."""
    from testbed.run_nodes import run_node

    return run_node("GroupOffload", model=plain, blocks_per_group=1, resident_gb=0.0, **settings).outputs[0]


def offload_row(row: Row, plain: Any, settings: dict[str, Any], config: BenchConfig, balloon: Balloon,
                out: Path | None = None) -> None:
    """This pack's node on ``plain``; with ``out``, the first timed step is traced."""
    if not ROWS.begin(row, config):
        return
    try:
        offloaded = offload_node(plain, settings)
    except ValueError as error:  # the node refused this model (ComfyUI's style): the row says why, the rest run
        row.skipped = f"the node refused it: {error}"
        end_row(row)
        return
    sample_row(row, offloaded, config, balloon, out)


def offload_rows(family: str, plain: Any, config: BenchConfig, balloon: Balloon, dtype: str, cap: int,
                 rows: tuple[tuple[str, dict[str, Any]], ...], out: Path | None) -> None:
    """This pack's node on ``plain`` at ``cap``, one row per mode; with ``out``, ``PROFILED_MODE`` is traced."""
    for mode, settings in rows:
        offload_row(Row(family, "this pack", mode, dtype, cap), plain, settings, config, balloon,
                    out if mode == PROFILED_MODE else None)


def comfy_rows(family: str, system: str, model: Any, config: BenchConfig, balloon: Balloon, dtype: str,
               caps: tuple[int | None, ...]) -> None:
    for cap in caps:
        sample_row(Row(family, system, "resident" if cap is None else "its own", dtype, cap), model, config, balloon)
