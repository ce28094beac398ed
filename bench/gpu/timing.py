"""Timing a step (a device sync at each of KSampler's step callbacks), the copy bandwidths, and one step's
profiler trace with the arithmetic of how much its copies and kernels overlapped."""
from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import BenchConfig


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RowOverTime(Exception):
    """The row has had its time: sampling stops after the current step, the steps so far are kept."""


class StepClock:
    """KSampler's per-step callback: a device sync and a timestamp after each step; ``at_step``
    callbacks run after the step they name (0 = the warm-up). Past ``limit_s`` it raises
    :class:`RowOverTime` after the step's callback, once one timed step is in."""

    def __init__(self, device: torch.device, at_step: dict[int, Callable[[], None]] | None = None,
                 limit_s: float | None = None) -> None:
        self.device, self.at_step = device, at_step or {}
        self.times = [time.perf_counter()]
        self.deadline = None if limit_s is None else self.times[0] + limit_s

    def __call__(self, step: int, *_: Any) -> None:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        if step in self.at_step:
            self.at_step[step]()
        if step >= 1 and self.deadline is not None and self.times[-1] > self.deadline:
            raise RowOverTime

    @property
    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


class CallCounter:
    """Counts calls of the diffusion model (1 per step when cond and uncond run batched)."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        self._hook = model.model.diffusion_model.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._hook.remove()


def measure_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s: pinned and pageable host-to-device, and device-to-host into fresh pageable memory."""
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def best(copy: Callable[[], Any]) -> float:
        seconds = []
        for _ in range(5):
            synchronize(device)
            start = time.perf_counter()
            copy()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        return nbytes / min(seconds) / 1e9

    return {"h2d_pinned_gbps": best(lambda: target.copy_(pinned, non_blocking=True)),
            "h2d_pageable_gbps": best(lambda: target.copy_(pageable)),
            "d2h_fresh_pageable_gbps": best(lambda: target.to("cpu", copy=True))}


class StepProfile:
    """A ``torch.profiler`` trace of one sampling step (between two step callbacks)."""

    def __init__(self, config: BenchConfig, out: Path, name: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if config.device.type == "cuda" else [])
        self.profiler = profile(activities=activities)
        self.out, self.name = out, name

    def start(self) -> None:
        self.profiler.start()

    def stop(self) -> None:
        self.profiler.stop()

    def write(self) -> dict[str, Any]:
        """The gzipped chrome trace, and how much copies and kernels overlapped in it."""
        raw = self.out / "trace.json"
        self.profiler.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text()).get("traceEvents", [])
        with raw.open("rb") as source, gzip.open(self.out / self.name, "wb") as target:
            target.write(source.read())
        raw.unlink()
        return {"trace": self.name, **overlap_figures(events)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From a chrome trace: the step's GPU span, and the shares of it with copies, kernels and both."""
    copies = _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and "dur" in e])
    kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e])
    if not kernels:
        return {"gpu_events": False}
    span = max(kernels[-1][1], copies[-1][1] if copies else 0) - min(kernels[0][0], copies[0][0] if copies else 1e30)
    both = _intersection(copies, kernels)
    copy_time = _length(copies)
    return {"gpu_events": True, "span_ms": span / 1e3, "copy_ms": copy_time / 1e3, "kernel_ms": _length(kernels) / 1e3,
            "overlap_of_step": both / span, "copy_hidden": both / copy_time if copy_time else None,
            "gpu_idle_of_step": 1 - _length(_union(copies + kernels)) / span}
