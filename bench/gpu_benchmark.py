"""GPU benchmark: full-size Qwen-Image through ComfyUI's sampler, this pack against ComfyUI as shipped.

One command, on a machine with CUDA (about 6 minutes on one H200)::

    .venv/bin/python bench/gpu_benchmark.py            # results in $OUT, else .artifacts/gpu
    .venv/bin/python bench/gpu_benchmark.py --smoke    # every family and row, tiny, on the CPU

The model is ComfyUI's own Qwen-Image (60 blocks, 40.8 GB in bf16) with seeded random weights, handed
to ComfyUI's ``load_diffusion_model_state_dict`` as a loaded file would be. Every row samples it
through ``comfy.sample.sample`` (KSampler's path: ``load_models_gpu`` with the latent's memory
estimate, cond and uncond batched when ComfyUI finds room) at 1664×928 with 128 text tokens, euler,
cfg 4: one warm-up step (it includes the load), then the timed steps, each ended by a device sync.

**The cap is a balloon**: before a capped row, (total − cap) bytes are allocated on the card and
held, so that every allocator and every free-memory query (ComfyUI's, comfy-aimdo's, the pack's
``auto``) sees a card of that size. Caps: 40 and 24 GiB in bf16, 16 GiB in fp8.

Families, each in its own process (one per way ComfyUI starts), each printing one ``RESULT`` line
per row the moment the row ends, so that a row that runs out of time or memory loses only itself:

- ``shipped``   started as ComfyUI 0.33.0's main.py starts (comfy-aimdo's Dynamic VRAM and the
                ``cudaMallocAsync`` allocator where it picks them): all resident (uncapped); ComfyUI
                as shipped at each cap; this pack's node (as a user wires it, on the Dynamic VRAM
                model) with ``auto``, ``stream_all`` prefetch 1 and 2 at each cap; one profiled step;
- ``legacy``    ComfyUI with ``--disable-dynamic-vram``: its legacy partial load at each cap;
- ``fp8``       as ``shipped``, with an fp8 (e4m3fn) checkpoint, at 16 GiB;
- ``baselines`` bare forwards of the same model outside ComfyUI's sampler: the copy-back baseline
                (diffusers' group offloading before the fix) and diffusers 0.42's own group
                offloading, ``use_stream`` False and True (skipped when not importable).

Per row: s/step, × all resident, streamed GB/step, achieved GB/s and its share of the measured
pinned peak, step ÷ max(compute, streamed bytes ÷ pinned bandwidth), GPU wait ms/step, model calls
per step, pinned host bytes, peak host RSS. JSON, a markdown table, a PNG chart and the profiled
step's chrome trace (with the share of that step in which copies and kernels overlapped) go to the
output folder.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import inspect
import json
import logging
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench_paths import REPO_ROOT
from copy_back import CopyBackOffload
from reporting import fmt, markdown_table

log = logging.getLogger("gpu_benchmark")

GIB = 2**30
RESULT_PREFIX = "RESULT "
FAMILIES = ("pack", "shipped", "lora", "lora-native", "fp8", "baselines", "legacy")
# Seconds each family may take at most on a GPU, in order of importance (the last takes what is left).
FAMILY_SHARE = {"pack": 0.45, "shipped": 0.2, "lora": 0.15, "lora-native": 0.1, "fp8": 0.15, "baselines": 0.15,
                "legacy": 1.0}
OFFLOAD_ROWS = (("auto", {"residency": "auto", "prefetch": 1}),
                ("stream_all p1", {"residency": "stream_all", "prefetch": 1}),
                ("stream_all p2", {"residency": "stream_all", "prefetch": 2}))


@dataclass(frozen=True)
class BenchConfig:
    smoke: bool = False
    blocks: int = 60
    heads: int = 24
    head_dim: int = 128
    joint_dim: int = 3584
    width: int = 1664
    height: int = 928
    text_tokens: int = 128
    caps_bytes: tuple[int, ...] = (40 * GIB, 24 * GIB)
    fp8_caps_bytes: tuple[int, ...] = (16 * GIB,)
    steps: int = 2  # timed, after one warm-up step
    row_limit_s: float = 60.0  # a row stops after the step that passes it (the steps so far are kept)
    lora_rank: int = 16
    pool_numel: int = 1 << 24  # random values tiled into the weights

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.smoke else "cuda")


def smoke_config() -> BenchConfig:
    """Three blocks of width 64 at 64×64 on the CPU; the caps are labels only (nothing is enforced)."""
    return BenchConfig(smoke=True, blocks=3, heads=2, head_dim=32, joint_dim=64, width=64, height=64,
                       text_tokens=8, steps=2, pool_numel=1 << 12, caps_bytes=(2 * 2**20, 2**20),
                       fp8_caps_bytes=(2**20,))


@dataclass
class Row:
    family: str
    system: str  # all resident | this pack | ComfyUI (Dynamic VRAM) | ComfyUI legacy | copy-back | diffusers
    mode: str
    dtype: str
    cap_bytes: int | None  # None: the whole card
    step_s: list[float] = field(default_factory=list)
    first_step_s: float | None = None  # the warm-up step, the load included
    streamed_bytes: float | None = None  # host-to-device per step (an estimate for ComfyUI's rows: see note)
    d2h_bytes: float | None = None
    copies: float | None = None
    compute_wait_ms: float | None = None
    calls_per_step: float | None = None
    resident_groups: int | None = None
    pinned_bytes: int | None = None  # this pack's page-locked mirrors
    comfy_pinned_bytes: int | None = None  # ComfyUI's own pinned-memory total
    peak_rss_bytes: int | None = None
    note: str = ""
    skipped: str | None = None

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None


def emit(kind: str, payload: dict[str, Any]) -> None:
    """One line for the parent: a row the moment it ends, or a fact about the family."""
    print(RESULT_PREFIX + json.dumps({"kind": kind, **payload}), flush=True)


# --------------------------------------------------------------------------------------------
# Weights, ComfyUI, the balloon
# --------------------------------------------------------------------------------------------

class RandomWeights:
    """Seeded weights like the test fixtures (N(0, 1/fan_in), norm scales 1 + N(0, 0.02²), biases
    N(0, 0.02²)), tiled from one random pool so that 40 GB are written at memory speed."""

    def __init__(self, pool_numel: int, seed: int = 0) -> None:
        self._pool = torch.randn(pool_numel, generator=torch.Generator().manual_seed(seed))
        self._scaled: dict[tuple[float, float, torch.dtype], torch.Tensor] = {}

    def _pool_for(self, scale: float, shift: float, dtype: torch.dtype) -> torch.Tensor:
        key = (scale, shift, dtype)
        if key not in self._scaled:
            values = (self._pool * scale + shift).to(dtype)
            self._scaled[key] = torch.cat([values, values])  # any window of pool length is contiguous
        return self._scaled[key]

    def _scale(self, name: str, shape: torch.Size) -> tuple[float, float]:
        if name.endswith("bias"):
            return 0.02, 0.0
        if len(shape) == 1:
            return 0.02, 1.0
        return shape[1:].numel() ** -0.5, 0.0

    def _values(self, name: str, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
        """``name``'s pool, its window length and where ``name``'s values start in it."""
        pool = self._pool_for(*self._scale(name, shape), dtype)
        length = pool.numel() // 2
        return pool, length, zlib.crc32(name.encode()) % length

    def window(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A view of the pool for ``name`` (no memory of its own) when it fits in one window."""
        pool, length, offset = self._values(name, shape, dtype)
        if shape.numel() > length:
            return self.filled(name, shape, dtype)
        return pool[offset : offset + shape.numel()].view(shape)

    def filled(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of its own holding ``name``'s values."""
        out = torch.empty(shape, dtype=dtype)
        self(name, out)
        return out

    def __call__(self, name: str, out: torch.Tensor) -> None:
        pool, length, offset = self._values(name, out.shape, out.dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), length):
            chunk = flat[start : start + length]
            chunk.copy_(pool[offset : offset + chunk.numel()])


def fill_module(module: nn.Module, fill: RandomWeights) -> None:
    """Write ``fill``'s values into every parameter and buffer of ``module``."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        fill(name, tensor.data)


def comfy_qwen_on_meta(config: BenchConfig) -> nn.Module:
    """ComfyUI's Qwen-Image at this size on the meta device, every weight made (no memory)."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from fixture_models import qwen_rope_axes

    with eager_weights():
        return QwenImageTransformer2DModel(num_layers=config.blocks, attention_head_dim=config.head_dim,
                                           num_attention_heads=config.heads, joint_attention_dim=config.joint_dim,
                                           axes_dims_rope=qwen_rope_axes(config.head_dim), dtype=torch.bfloat16,
                                           device="meta", operations=comfy.ops.disable_weight_init)


def comfy_qwen_shapes(config: BenchConfig) -> dict[str, torch.Size]:
    """The state-dict shapes of ComfyUI's Qwen-Image at this size."""
    return {name: t.shape for name, t in comfy_qwen_on_meta(config).state_dict().items()}


@contextlib.contextmanager
def eager_weights() -> Iterator[None]:
    """ComfyUI's layers made with every weight: Dynamic VRAM's switch makes a Linear's weight wait for
    the state dict (no shape to read before it)."""
    memory_management = sys.modules.get("comfy.memory_management")
    switched = getattr(memory_management, "aimdo_enabled", False)
    if switched:
        memory_management.aimdo_enabled = False
    try:
        yield
    finally:
        if switched:
            memory_management.aimdo_enabled = True


def random_state_dict(config: BenchConfig, dtype: torch.dtype, owned: bool) -> dict[str, torch.Tensor]:
    """The checkpoint as ComfyUI's loader would read it. ``owned``: every tensor has its own memory
    (Dynamic VRAM takes the tensors as the model's weights); else views of one pool, which a
    copying load turns into distinct weights without holding the model twice."""
    weights = RandomWeights(config.pool_numel)
    make = weights.filled if owned else weights.window
    return {name: make(name, shape, dtype if len(shape) > 1 else torch.bfloat16)  # fp8 files keep 1-D tensors bf16
            for name, shape in comfy_qwen_shapes(config).items()}


def start_comfyui(config: BenchConfig, dynamic: bool) -> str:
    """Import ComfyUI into this process as main.py starts it; returns which patcher it runs.

    ``dynamic``: comfy-aimdo's library first, then its devices, ``ModelPatcherDynamic`` as the core
    patcher and the global switch, as main.py does by default. Without CUDA (``--smoke``) ComfyUI
    runs ``--cpu``, which switches Dynamic VRAM off in main.py too.
    """
    from comfy_boot import boot_comfyui_in_process, prepare_comfy_import
    from fixture_models import widen_qwen_detection

    prepare_comfy_import(cpu=config.smoke)
    if dynamic and not config.smoke:
        import comfy_aimdo.control

        _call_first_accepted(comfy_aimdo.control.init, dict(simple_vram_headroom=None, nvml_pressure=True),
                             dict(simple_vram_headroom=None), {})
    boot_comfyui_in_process(cpu=config.smoke)
    if config.smoke:
        widen_qwen_detection()  # the tiny model's widths (full-size Qwen-Image is detected as it is)
    if not dynamic or config.smoke:
        return "legacy ModelPatcher"
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control
    from comfy.cli_args import args

    devices = mm.get_all_torch_devices()
    try:
        started = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * GIB)) for d in devices)
    except TypeError:
        started = comfy_aimdo.control.init_devices(d.index for d in devices)
    if not started:
        return "legacy ModelPatcher (comfy-aimdo did not start)"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return "Dynamic VRAM (ModelPatcherDynamic)"


def _call_first_accepted(function: Callable[..., Any], *keyword_sets: dict[str, Any]) -> Any:
    """``function(**kwargs)`` with the first keyword set this version accepts (older protocols take fewer)."""
    for kwargs in keyword_sets[:-1]:
        try:
            return function(**kwargs)
        except TypeError:
            continue
    return function(**keyword_sets[-1])


def comfy_allocator_env() -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` as ComfyUI's main.py sets it (its ``cuda_malloc`` module decides)."""
    from comfy_boot import comfyui_path

    probe = ("import os, sys; sys.path.insert(0, sys.argv[1]); import cuda_malloc; "
             "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))")
    done = subprocess.run([sys.executable, "-c", probe, str(comfyui_path())], capture_output=True, text=True,
                          cwd=comfyui_path())
    value = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return {"PYTORCH_CUDA_ALLOC_CONF": value} if value else {}


def load_comfy_model(config: BenchConfig, dtype: torch.dtype, dynamic_patcher: bool) -> Any:
    """A MODEL from ComfyUI's own loader, with a loader ComfyUI can call again (as for a file)."""
    import comfy.sd

    accepts = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters

    def load(disable_dynamic: bool = False) -> Any:
        owned = not disable_dynamic and dynamic_patcher  # Dynamic VRAM keeps the tensors it is given
        state_dict = random_state_dict(config, dtype, owned=owned)
        extra = {"disable_dynamic": disable_dynamic} if accepts else {}
        return comfy.sd.load_diffusion_model_state_dict(state_dict, model_options={}, **extra)

    model = load(disable_dynamic=not dynamic_patcher)
    model.cached_patcher_init = (load, ())
    return model


class Balloon:
    """Holds (total − cap) bytes of the card so that everyone sees a card of ``cap`` bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: torch.Tensor | None = None

    def set_cap(self, cap: int | None) -> None:
        """Unload every model (ComfyUI loads again at the next run, planning against the new card)."""
        import comfy.model_management as mm

        self._held = None
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache(True)
        if self.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        if cap is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            self._held = torch.empty(max(0, total - cap), dtype=torch.uint8, device=self.device)


# --------------------------------------------------------------------------------------------
# One row: a sampling run through ComfyUI, timed per step
# --------------------------------------------------------------------------------------------

def conditioning(config: BenchConfig, seed: int) -> list:
    cond = torch.randn((1, config.text_tokens, config.joint_dim), generator=torch.Generator().manual_seed(seed))
    return [[cond, {"pooled_output": None}]]


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int | None:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()) if Path("/proc/self/status").exists() else None
    return int(match.group(1)) * 1024 if match else None


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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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


def sample_row(row: Row, model: Any, config: BenchConfig, balloon: Balloon,
               at_step: dict[int, Callable[[], None]] | None = None) -> Row:
    """Sample 1 + ``config.steps`` steps with ``model`` at the row's cap and fill the row."""
    import comfy.model_management as mm
    import comfy.sample

    steps = 1 + config.steps
    at_step = dict(at_step or {})
    first = at_step.get(0)

    def after_warmup() -> None:
        handle = offload_handle(model)  # built at the first load
        if handle is not None:
            handle.reset_stats()
        counter.calls = 0
        if first is not None:
            first()

    at_step[0] = after_warmup
    counter = CallCounter(model)
    try:
        balloon.set_cap(row.cap_bytes)
        reset_peak_rss()
        latent = torch.zeros((1, 16, config.height // 8, config.width // 8))
        latent = comfy.sample.fix_empty_latent_channels(model, latent)
        noise = comfy.sample.prepare_noise(latent, 0)
        clock = StepClock(config.device, at_step, config.row_limit_s)
        try:
            with torch.inference_mode():
                comfy.sample.sample(model, noise, steps, 4.0, "euler", "simple", conditioning(config, 1),
                                    conditioning(config, 2), latent, denoise=1.0, callback=clock, disable_pbar=True,
                                    seed=0)
        except RowOverTime:
            row.note = f"stopped past the row's {config.row_limit_s:.0f} s after {len(clock.steps) - 1} timed step(s)"
        row.first_step_s, row.step_s = clock.steps[0], clock.steps[1:]
        row.calls_per_step = counter.calls / len(row.step_s)
        row.peak_rss_bytes = peak_rss_bytes()
        row.comfy_pinned_bytes = getattr(mm, "TOTAL_PINNED_MEMORY", None)
        _read_loaded(row, model, offload_handle(model), len(row.step_s))
    except torch.cuda.OutOfMemoryError as error:
        row.skipped = f"out of memory: {str(error).splitlines()[0][:160]}"
    finally:
        counter.remove()
    log.info("%s %s, cap %s: %s", row.system, row.mode, _cap(row.cap_bytes),
             row.skipped or f"{row.seconds:.3f} s/step (first {row.first_step_s:.1f} s)")
    emit("row", asdict(row))
    return row


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


def _cap(cap: int | None) -> str:
    return "whole card" if cap is None else f"{cap / GIB:.0f} GiB" if cap >= GIB else f"{cap / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------------
# Bandwidth and the profiled step
# --------------------------------------------------------------------------------------------

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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# --------------------------------------------------------------------------------------------
# The families
# --------------------------------------------------------------------------------------------

PROFILED_MODE = "stream_all p1"  # at the smallest cap


def offload_node(plain: Any, settings: dict[str, Any]) -> Any:
    """This pack's node on ``plain``, as a user wires it."""
    from run_nodes import run_node

    return run_node("GroupOffload", model=plain, blocks_per_group=1, resident_gb=0.0, **settings).outputs[0]


def offload_row(row: Row, plain: Any, settings: dict[str, Any], config: BenchConfig, balloon: Balloon,
                out: Path | None = None) -> None:
    """This pack's node on ``plain``; with ``out``, the first timed step is traced."""
    if out is None:
        sample_row(row, offload_node(plain, settings), config, balloon)
        return
    name = "step_trace_" + re.sub(r"[^a-z0-9]+", "_", f"{row.family} {row.mode}".lower()).strip("_") + ".json.gz"
    profile = StepProfile(config, out, name)
    sample_row(row, offload_node(plain, settings), config, balloon, {0: profile.start, 1: profile.stop})
    if not row.skipped:
        emit("trace", {"family": row.family, "mode": row.mode, "cap_bytes": row.cap_bytes, **profile.write()})


def _offload_rows(family: str, plain: Any, config: BenchConfig, balloon: Balloon, dtype: str, cap: int,
                  rows: tuple[tuple[str, dict[str, Any]], ...], out: Path | None) -> None:
    """This pack's node on ``plain`` at ``cap``, one row per mode; with ``out``, ``PROFILED_MODE`` is traced."""
    for mode, settings in rows:
        offload_row(Row(family, "this pack", mode, dtype, cap), plain, settings, config, balloon,
                    out if mode == PROFILED_MODE else None)


def pageable_row(family: str, plain: Any, config: BenchConfig, balloon: Balloon, cap: int,
                 pinned_share: float = 0.0) -> None:
    """``stream_all`` prefetch 1 under a pinned-memory limit of ``pinned_share`` of the model: with none
    (``--disable-pinned-memory``) every mirror stays pageable; with some (Windows past its limit) the
    groups past it stream through the pinned staging ring."""
    import comfy.model_management as mm

    mode = ("stream_all p1, pins refused" if not pinned_share else
            f"stream_all p1, pins capped at {pinned_share:.0%} (staging ring)")
    if pinned_share and config.device.type != "cuda":
        emit("row", asdict(Row(family, "this pack", mode, "bf16", cap, skipped="needs CUDA: ComfyUI pins nothing under --cpu")))
        return
    offloaded = offload_node(plain, {"residency": "stream_all", "prefetch": 1})
    handle = offload_handle(offloaded)
    if handle is not None:
        handle.unpin()
    limit, mm.MAX_PINNED_MEMORY = mm.MAX_PINNED_MEMORY, int(pinned_share * plain.model_size())
    try:
        sample_row(Row(family, "this pack", mode, "bf16", cap), offloaded, config, balloon)
    finally:
        mm.MAX_PINNED_MEMORY = limit


def host_budget_row(family: str, plain: Any, config: BenchConfig, balloon: Balloon, cap: int,
                    share: float = 0.25) -> None:
    """``stream_all`` prefetch 1 with a host budget of ``share`` of the model (issue 23): the groups past it keep
    their tensors in place and are gathered at each onload (on CUDA into the pinned staging ring, by the gather
    worker). The family loads no file, so in place are ComfyUI's own tensors, none file-backed. Last of its
    family: a row that fails loses only itself."""
    mode = f"stream_all p1, host budget {share:.0%} (in place: ComfyUI's tensors)"
    settings = {"residency": "stream_all", "prefetch": 1, "host_memory": "budget",
                "host_gb": share * plain.model_size() / GIB}  # host_gb is in GiB, as the node reads it
    offload_row(Row(family, "this pack", mode, "bf16", cap), plain, settings, config, balloon)


def _comfy_rows(family: str, system: str, model: Any, config: BenchConfig, balloon: Balloon, dtype: str,
                caps: tuple[int | None, ...]) -> None:
    for cap in caps:
        sample_row(Row(family, system, "resident" if cap is None else "its own", dtype, cap), model, config, balloon)


def shipped_family(config: BenchConfig, out: Path) -> None:
    """Newest ComfyUI as main.py starts it (Dynamic VRAM), bf16: all resident and its own rows."""
    patcher = start_comfyui(config, dynamic=True)
    emit("fact", {"patcher": patcher, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")})
    balloon = Balloon(config.device)
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    emit("fact", {"model_bytes": plain.model_size()})
    system = "ComfyUI (Dynamic VRAM)" if "Dynamic" in patcher else "ComfyUI legacy"
    sample_row(Row("shipped", "all resident", "resident", "bf16", None), plain, config, balloon)
    _comfy_rows("shipped", system, plain, config, balloon, "bf16", tuple(sorted(config.caps_bytes)))


def pack_family(config: BenchConfig, out: Path) -> None:
    """This pack's node on the model newest ComfyUI loaded (Dynamic VRAM), bf16, in a process of its own:
    ComfyUI's pinned copy of the model from its own rows would stay beside the pack's mirrors (on the
    H200's 125 GiB that was one copy too many: the shared process was killed)."""
    start_comfyui(config, dynamic=True)
    device = config.device
    emit("fact", {"bandwidth": measure_bandwidth(device, GIB if device.type == "cuda" else 16 * 2**20)})
    balloon = Balloon(device)
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    smallest = min(config.caps_bytes)
    for cap in sorted(config.caps_bytes):  # the smallest card first: where the systems differ most
        _offload_rows("pack", plain, config, balloon, "bf16", cap, OFFLOAD_ROWS, out if cap == smallest else None)
    pageable_row("pack", plain, config, balloon, smallest)
    pageable_row("pack", plain, config, balloon, smallest, pinned_share=0.5)
    host_budget_row("pack", plain, config, balloon, smallest)


def lora_rows(family: str, config: BenchConfig, out: Path) -> None:
    """A third of the blocks, every one streamed, with and without a LoRA on every attention projection:
    what the LoRA's temporaries cost the overlap under this process's allocator (``lora``: ComfyUI's
    default, cudaMallocAsync on cu130; ``lora-native``: torch's own, as ``--disable-cuda-malloc``)."""
    start_comfyui(config, dynamic=True)
    import comfy.sd

    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "torch's native allocator"
    config = replace(config, blocks=max(1, config.blocks // 3))
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    dtype = f"bf16, {config.blocks} blocks"
    settings, balloon = {"residency": "stream_all", "prefetch": 1}, Balloon(config.device)
    offload_row(Row(family, "this pack", "stream_all p1", dtype, None, note=allocator), plain, settings, config,
                balloon, out)
    with_lora = comfy.sd.load_lora_for_models(plain, None, attention_lora(config), 0.8, 0)[0]
    note = f"{allocator}; LoRA rank {config.lora_rank} on {len(with_lora.patches)} weights"
    offload_row(Row(family, "this pack", "stream_all p1 + LoRA", dtype, None, note=note), with_lora, settings,
                config, balloon, out)


def attention_lora(config: BenchConfig) -> dict[str, torch.Tensor]:
    """A LoRA of ``config.lora_rank`` on every attention projection of the blocks, ComfyUI's generic keys."""
    generator = torch.Generator().manual_seed(3)
    lora = {}
    for name, shape in comfy_qwen_shapes(config).items():
        if name.startswith("transformer_blocks.") and ".attn." in name and name.endswith(".weight") and len(shape) == 2:
            stem = "diffusion_model." + name.removesuffix(".weight")
            lora[f"{stem}.lora_up.weight"] = (torch.randn(shape[0], config.lora_rank, generator=generator) * 0.01).bfloat16()
            lora[f"{stem}.lora_down.weight"] = (torch.randn(config.lora_rank, shape[1], generator=generator) * 0.01).bfloat16()
    return lora


def legacy_family(config: BenchConfig, out: Path) -> None:
    """ComfyUI with --disable-dynamic-vram: its legacy partial load (pinned, async offload streams)."""
    start_comfyui(config, dynamic=False)
    model = load_comfy_model(config, torch.bfloat16, dynamic_patcher=False)
    caps = (min(config.caps_bytes),)  # 40 GiB was measured on the H200 already (the whole model fits)
    _comfy_rows("legacy", "ComfyUI legacy", model, config, Balloon(config.device), "bf16", caps)


def fp8_family(config: BenchConfig, out: Path) -> None:
    """An fp8 (e4m3fn) checkpoint, newest ComfyUI as shipped against this pack."""
    patcher = start_comfyui(config, dynamic=True)
    balloon = Balloon(config.device)
    plain = load_comfy_model(config, torch.float8_e4m3fn, dynamic_patcher=True)
    system = "ComfyUI (Dynamic VRAM)" if "Dynamic" in patcher else "ComfyUI legacy"
    _comfy_rows("fp8", system, plain, config, balloon, "fp8", config.fp8_caps_bytes)
    sample_row(Row("fp8", "all resident", "resident", "fp8", None), plain, config, balloon)
    for cap in config.fp8_caps_bytes:
        _offload_rows("fp8", plain, config, balloon, "fp8", cap, OFFLOAD_ROWS[:2], None)


# --- baselines: bare forwards outside ComfyUI's sampler ----------------------------------------

def bare_forward(model: nn.Module, config: BenchConfig) -> Callable[[], Any]:
    """One ComfyUI-style model call: batch 2 (cond + uncond), 5-D latent, bf16."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((2, 16, 1, config.height // 8, config.width // 8), generator=generator).to(config.device, torch.bfloat16)
    context = torch.randn(2, config.text_tokens, config.joint_dim, generator=generator).to(config.device, torch.bfloat16)
    timestep = torch.full((2,), 0.5, device=config.device)
    return lambda: model(x, timestep, context, transformer_options={})


def time_bare(row: Row, step: Callable[[], Any], config: BenchConfig, balloon: Balloon, meter: Any = None) -> Row:
    """One timed call, without a warm-up: a baseline call takes tens of seconds, mostly copies."""
    try:
        balloon.set_cap(row.cap_bytes)
        reset_peak_rss()
        with torch.inference_mode():
            started = time.perf_counter()
            step()
            synchronize(config.device)
            row.step_s = [time.perf_counter() - started]
        row.calls_per_step, row.peak_rss_bytes = 1.0, peak_rss_bytes()
        if meter is not None:
            stats = meter.stats()
            row.streamed_bytes, row.d2h_bytes, row.copies = stats["bytes_h2d"], stats["bytes_d2h"], stats["copies_h2d"]
    except torch.cuda.OutOfMemoryError as error:
        row.skipped = f"out of memory: {str(error).splitlines()[0][:160]}"
    log.info("%s %s: %s", row.system, row.mode, row.skipped or f"{row.seconds:.3f} s/step")
    emit("row", asdict(row))
    return row


def copy_back_row(config: BenchConfig, balloon: Balloon, cap: int) -> None:
    model = comfy_qwen_on_meta(config).to_empty(device="cpu").eval().requires_grad_(False)
    fill_module(model, RandomWeights(config.pool_numel))
    for name, module in model.named_children():
        if name != "transformer_blocks":
            module.to(config.device)
    baseline = CopyBackOffload(list(model.transformer_blocks), config.device)
    time_bare(Row("baselines", "copy-back", "copy-back (diffusers before the fix)", "bf16", cap),
              bare_forward(model, config), config, balloon, baseline)
    baseline.remove()


def build_diffusers_model(config: BenchConfig) -> nn.Module:
    from fixture_models import qwen_rope_axes
    from diffusers import QwenImageTransformer2DModel

    dims = dict(num_layers=config.blocks, attention_head_dim=config.head_dim, num_attention_heads=config.heads,
                joint_attention_dim=config.joint_dim, axes_dims_rope=qwen_rope_axes(config.head_dim))
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**dims)
    # Its RoPE frequency tables are plain attributes, not buffers: build that module for real.
    model.pos_embed = type(model.pos_embed)(theta=10000, axes_dim=list(dims["axes_dims_rope"]), scale_rope=True)
    model = model.to(torch.bfloat16).to_empty(device="cpu").eval().requires_grad_(False)
    fill_module(model, RandomWeights(config.pool_numel))
    return model


def diffusers_forward(model: nn.Module, config: BenchConfig) -> Callable[[], Any]:
    """The same call as :func:`bare_forward` in diffusers' terms (packed latents, img_shapes)."""
    generator = torch.Generator().manual_seed(0)
    grid = (config.height // 16, config.width // 16)
    device = config.device
    latents = torch.randn(2, grid[0] * grid[1], 64, generator=generator).to(device, torch.bfloat16)
    context = torch.randn(2, config.text_tokens, config.joint_dim, generator=generator).to(device, torch.bfloat16)
    kwargs = dict(hidden_states=latents, encoder_hidden_states=context,
                  timestep=torch.full((2,), 0.5, device=device, dtype=torch.bfloat16),
                  encoder_hidden_states_mask=torch.ones(2, config.text_tokens, dtype=torch.long, device=device),
                  img_shapes=[[(1, *grid)]] * 2, return_dict=False)
    if "txt_seq_lens" in inspect.signature(model.forward).parameters:
        kwargs["txt_seq_lens"] = [config.text_tokens] * 2
    return lambda: model(**kwargs)


def _diffusers_missing() -> str | None:
    """Why diffusers' group offloading cannot run here, or ``None``."""
    try:
        from diffusers.utils import is_accelerate_available
    except ImportError as error:
        return f"diffusers not importable ({error})"
    return None if is_accelerate_available() else "diffusers' group offloading needs accelerate, which is not importable"


def diffusers_rows(config: BenchConfig, balloon: Balloon, cap: int) -> None:
    for use_stream in (True, False):  # use_stream=False was measured on the H200 already
        row = Row("baselines", "diffusers", f"group offload, use_stream={use_stream}", "bf16", cap)
        row.skipped = _diffusers_missing() or (None if config.device.type == "cuda" or not use_stream
                                               else "use_stream needs CUDA streams")
        if row.skipped:
            emit("row", asdict(row))
            continue
        model = build_diffusers_model(config)
        row.streamed_bytes = float(sum(t.nbytes for t in (*model.parameters(), *model.buffers())))
        row.d2h_bytes = 0.0 if use_stream else row.streamed_bytes
        model.enable_group_offload(onload_device=config.device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream)
        time_bare(row, diffusers_forward(model, config), config, balloon)
        del model
        gc.collect()


def baselines_family(config: BenchConfig, out: Path) -> None:
    start_comfyui(config, dynamic=False)
    balloon, cap = Balloon(config.device), min(config.caps_bytes)
    diffusers_rows(config, balloon, cap)
    gc.collect()
    copy_back_row(config, balloon, cap)


WORKERS: dict[str, Callable[[BenchConfig, Path], None]] = {
    "pack": pack_family, "shipped": shipped_family, "lora": lambda config, out: lora_rows("lora", config, out),
    "lora-native": lambda config, out: lora_rows("lora-native", config, out), "fp8": fp8_family,
    "baselines": baselines_family, "legacy": legacy_family}


# --------------------------------------------------------------------------------------------
# Parent: run the families, derive the figures, write the results
# --------------------------------------------------------------------------------------------

def run_family(family: str, config: BenchConfig, timeout: float, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """The family's RESULT lines as they come; a timeout or a crash keeps the rows already reported."""
    command = [sys.executable, __file__, "--worker", family, "--config", json.dumps(asdict(config)), "--out", str(out)]
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


def derive(rows: list[dict[str, Any]], bandwidth: dict[str, float]) -> list[dict[str, Any]]:
    """× all resident, GB/s and its share of the pinned peak, step ÷ max(compute, bytes ÷ bandwidth)."""
    resident = {r["dtype"]: statistics.median(r["step_s"]) for r in rows if r["system"] == "all resident" and r["step_s"]}
    pinned = bandwidth.get("h2d_pinned_gbps")
    out = []
    for row in rows:
        seconds = statistics.median(row["step_s"]) if row["step_s"] else None
        compute = resident.get(row["dtype"])
        streamed = row["streamed_bytes"] or 0.0
        derived: dict[str, Any] = {"seconds": seconds, "ratio_to_resident": None, "achieved_gbps": None,
                                   "share_of_pinned_peak": None, "vs_bound": None}
        if seconds is not None:
            derived["ratio_to_resident"] = seconds / compute if compute else None
            if streamed:
                derived["achieved_gbps"] = streamed / seconds / 1e9
                derived["share_of_pinned_peak"] = derived["achieved_gbps"] / pinned if pinned else None
            if compute and pinned:
                derived["vs_bound"] = seconds / max(compute, streamed / (pinned * 1e9))
        out.append({**row, **derived})
    return out


def _gb(value: float | None) -> str:
    return fmt(None if value is None else value / 1e9, 2)


def results_markdown(rows: list[dict[str, Any]], facts: dict[str, Any], traces: list[dict[str, Any]],
                     header: str) -> str:
    bandwidth = facts.get("bandwidth", {})
    bw = ", ".join(f"{k.removesuffix('_gbps').replace('_', ' ')} {v:.1f}" for k, v in bandwidth.items())
    headers = ["system", "mode", "dtype", "cap", "s/step", "× all resident", "first step s (load)", "streamed GB/step",
               "GB/s", "of pinned peak", "step ÷ max(compute, bytes ÷ bw)", "GPU wait ms/step", "copies/step",
               "D2H GB/step", "model calls/step", "resident groups", "pinned GB (pack / ComfyUI)", "peak RSS GB", "note"]
    table = [[r["system"], r["mode"], r["dtype"], _cap(r["cap_bytes"]), fmt(r["seconds"], 3), fmt(r["ratio_to_resident"]),
              fmt(r["first_step_s"], 1), _gb(r["streamed_bytes"]), fmt(r["achieved_gbps"], 1),
              fmt(None if r["share_of_pinned_peak"] is None else 100 * r["share_of_pinned_peak"], 0) + "%"
              if r["share_of_pinned_peak"] is not None else "—",
              fmt(r["vs_bound"]), fmt(r["compute_wait_ms"], 1), fmt(r["copies"], 0), _gb(r["d2h_bytes"]),
              fmt(r["calls_per_step"], 1), "—" if r["resident_groups"] is None else str(r["resident_groups"]),
              f"{_gb(r['pinned_bytes'])} / {_gb(r['comfy_pinned_bytes'])}", _gb(r["peak_rss_bytes"]),
              r["skipped"] or r["note"]] for r in rows]
    lines = [header, "", f"Bandwidth (GB/s, 1 GiB copies): {bw or 'not measured'}.",
             f"ComfyUI started with: {facts.get('patcher', '?')}; allocator {facts.get('allocator') or 'default'}."]
    for trace in traces:
        if trace.get("gpu_events"):
            lines.append(f"Profiled step ({trace['family']}: {trace['mode']}, cap {_cap(trace['cap_bytes'])}, `{trace['trace']}`): "
                         f"GPU span {trace['span_ms']:.0f} ms, kernels {trace['kernel_ms']:.0f} ms, "
                         f"host-to-device copies {trace['copy_ms']:.0f} ms; copies and kernels overlapped during "
                         f"{100 * trace['overlap_of_step']:.0f} % of the step ({fmt(trace['copy_hidden'] and 100 * trace['copy_hidden'], 0)} % "
                         f"of the copy time hidden); GPU idle {100 * trace['gpu_idle_of_step']:.0f} % of the step.")
        else:
            lines.append(f"Profiled step ({trace['family']}: {trace['mode']}): `{trace['trace']}` (no GPU events on a CPU).")
    return "\n".join(lines) + "\n\n" + markdown_table(headers, table)


def write_chart(rows: list[dict[str, Any]], path: Path) -> bool:
    """A PNG bar chart of s/step per system at each cap (Pillow); False when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return False
    bars = [(f"{r['dtype']} {_cap(r['cap_bytes'])}  {r['system']}, {r['mode']}", r["seconds"]) for r in rows if r["seconds"]]
    if not bars:
        return False
    longest = max(s for _, s in bars)
    label_w, bar_w, line_h = 430, 520, 22
    image = Image.new("RGB", (label_w + bar_w + 90, line_h * len(bars) + 40), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), "seconds per sampling step (shorter is better)", fill="black")
    colours = {"this pack": (46, 125, 50), "all resident": (120, 120, 120)}
    for i, (label, seconds) in enumerate(bars):
        y = 30 + i * line_h
        system = label.split("  ", 1)[1].split(",")[0]
        draw.text((10, y + 4), label[:70], fill="black")
        width = max(1, int(bar_w * seconds / longest))
        draw.rectangle((label_w, y + 3, label_w + width, y + line_h - 3), fill=colours.get(system, (198, 40, 40)))
        draw.text((label_w + width + 6, y + 4), f"{seconds:.3f}", fill="black")
    image.save(path)
    return True


def environment(config: BenchConfig) -> str:
    if config.device.type == "cuda":
        props = torch.cuda.get_device_properties(config.device)
        gpu = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        gpu = "no GPU: --smoke on the CPU (caps are labels, bandwidths are host copies)"
    return (f"{gpu}; torch {torch.__version__}, Python {platform.python_version()}; Qwen-Image {config.blocks} blocks × "
            f"width {config.heads * config.head_dim}, {config.width}×{config.height}, {config.text_tokens} text tokens, "
            f"euler cfg 4, {config.steps} timed steps after 1 warm-up step; {time.strftime('%Y-%m-%d %H:%M')}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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


def write_results(config: BenchConfig, families: dict[str, dict[str, Any]], seconds: float, out: Path) -> int:
    facts = {k: v for f in families.values() for k, v in f["facts"].items()}
    rows = derive([r for f in families.values() for r in f["rows"]], facts.get("bandwidth", {}))
    traces = [t for f in families.values() for t in f["traces"]]
    errors = {name: f["error"] for name, f in families.items() if "error" in f}
    header = f"{environment(config)}; {seconds:.0f} s in all." + "".join(
        f"\n\nFamily {name}: {error}" for name, error in errors.items())
    markdown = results_markdown(rows, facts, traces, header)
    chart = write_chart(rows, out / "gpu_results.png")
    (out / "gpu_results.json").write_text(json.dumps(
        {"config": asdict(config), "facts": facts, "families": families, "rows": rows, "traces": traces,
         "seconds": seconds, "chart": chart}, indent=1))
    (out / "gpu_results.md").write_text(markdown + "\n")
    print(markdown)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
