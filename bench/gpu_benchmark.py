"""GPU benchmark: full-size Qwen-Image (60 blocks, bf16, random weights) streamed under a VRAM cap.

One command, on a machine with CUDA (< 8 minutes on one H200 or A100)::

    .venv/bin/python bench/gpu_benchmark.py            # results in $OUT, else .artifacts/gpu
    .venv/bin/python bench/gpu_benchmark.py --smoke    # the same code paths on the CPU, tiny model

The model is ComfyUI's own ``QwenImageTransformer2DModel`` (``comfy.ops.disable_weight_init``,
bf16), built on the meta device and given seeded random weights tiled from one random pool, written
straight into the engine's host mirrors (or into host tensors for the modes that need them).  No
file.  Each step is one forward of batch 2 at 1664×928 with 128 text tokens: cond and uncond
batched as ComfyUI's sampler runs them when they fit, so the weights cross the bus once per step.

The pinned host-to-device bandwidth is measured first.  Then, each family in its own process (host
memory is freed between them):

- ``pack``      all resident (uncapped reference); this pack at prefetch 0 and 1 (stream_all) and
                with ``auto``-like residency (budget = cap − activation reserve − weights outside the
                blocks − streaming slabs, the reserve measured on the prefetch-0 run); the copy-back
                baseline (``bench/copy_back.py``);
- ``comfy``     ComfyUI core partial loading (``ModelPatcher`` lowvram with its pinned memory and
                async offload streams), weights budget = cap − activation reserve;
- ``diffusers`` diffusers' own ``enable_group_offload`` (block_level, 1 block per group) on its
                Qwen-Image transformer, ``use_stream`` False and True (skipped when not importable).

VRAM is capped with ``torch.cuda.set_per_process_memory_fraction`` at 40 GiB and 24 GiB, each
clamped to the card's memory (the caching allocator's limit; the CUDA context is outside it).  Modes whose cost does not depend on
the cap (copy-back, diffusers) run at the smallest cap only; the slow synchronous baselines time
``--slow-steps`` steps.  Per mode: s/step, ratio to resident, streamed GB/step, achieved GB/s, and
step time ÷ max(compute time, streamed bytes ÷ pinned bandwidth), with compute time the resident
run's step (or 60 × one resident block when the model does not fit), and the cost model's estimate
from the same measured figures.  JSON and markdown go to ``$OUT``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Container, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path += [str(REPO_ROOT / "tests"), str(REPO_ROOT)]

from copy_back import CopyBackOffload  # noqa: E402
from offload_core import apply_group_offload  # noqa: E402
from offload_core.cost_model import DiT, pass_seconds  # noqa: E402
from reporting import fmt, markdown_table  # noqa: E402

log = logging.getLogger("gpu_benchmark")

GIB = 2**30
DTYPE = torch.bfloat16
RESULT_PREFIX = "RESULT "
FAMILIES = ("pack", "comfy", "diffusers")


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
    steps: int = 3
    warmup: int = 1
    slow_steps: int = 1
    probe_repeats: int = 5
    pool_numel: int = 1 << 24  # random values tiled into the weights
    activation_reserve: int | None = None  # measured by the pack family, used by the comfy family

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.smoke else "cuda")

    @property
    def dit(self) -> DiT:
        """The cost model's view of this transformer (its bytes, for the smoke caps)."""
        width = self.heads * self.head_dim
        return DiT(blocks=self.blocks, dim=width, heads=self.heads, ffn=4 * width, joint_dim=self.joint_dim)


def smoke_config() -> BenchConfig:
    """Three blocks of width 64 at 64×64 on the CPU; caps fit all and one group (not enforced on a CPU)."""
    config = BenchConfig(smoke=True, blocks=3, heads=2, head_dim=32, joint_dim=64, width=64, height=64,
                         text_tokens=8, steps=1, warmup=1, probe_repeats=1, pool_numel=1 << 12)
    total = config.dit.total_bytes
    return dataclasses.replace(config, caps_bytes=(2 * total, total))


@dataclass
class ModeResult:
    family: str
    mode: str
    label: str
    cap_bytes: int | None  # None: uncapped
    transfer: str  # resident | pinned_sync | pinned_prefetch | copy_back | comfy_async | pageable_sync
    step_s: list[float] = field(default_factory=list)
    streamed_bytes: float = 0.0  # host-to-device per step
    d2h_bytes: float = 0.0  # per step
    copies: float | None = None  # host-to-device copies per step
    hook_us_per_group: float | None = None
    compute_wait_ms: float | None = None  # per step
    resident_groups: int | None = None
    peak_device_bytes: int | None = None
    skipped: str | None = None

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None


# --------------------------------------------------------------------------------------------
# Shared pieces: ComfyUI import, weights, inputs, timing, the cap
# --------------------------------------------------------------------------------------------

def import_comfy(config: BenchConfig) -> None:
    """Make ``import comfy`` resolve to the embedded (or $COMFYUI_PATH) ComfyUI, on the right device."""
    from comfy_env import prepare_comfy_import

    prepare_comfy_import(cpu=config.smoke)


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

    def __call__(self, name: str, out: torch.Tensor) -> None:
        if name.endswith("bias"):
            scale, shift = 0.02, 0.0
        elif out.dim() == 1:
            scale, shift = 0.02, 1.0
        else:
            scale, shift = out.shape[1:].numel() ** -0.5, 0.0
        pool = self._pool_for(scale, shift, out.dtype)
        length = pool.numel() // 2
        flat, offset = out.view(-1), zlib.crc32(name.encode()) % length
        for start in range(0, flat.numel(), length):
            chunk = flat[start : start + length]
            chunk.copy_(pool[offset : offset + chunk.numel()])


def build_comfy_model(config: BenchConfig) -> nn.Module:
    """ComfyUI's QwenImageTransformer2DModel in bf16, on host memory that no one has touched yet."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from comfy_env import qwen_rope_axes

    model = QwenImageTransformer2DModel(num_layers=config.blocks, attention_head_dim=config.head_dim,
                                        num_attention_heads=config.heads, joint_attention_dim=config.joint_dim,
                                        axes_dims_rope=qwen_rope_axes(config.head_dim), dtype=DTYPE,
                                        device="meta", operations=comfy.ops.disable_weight_init)
    return model.to_empty(device="cpu").eval().requires_grad_(False)


def fill_tensors(module: nn.Module, fill: RandomWeights, skip: Container[int] = frozenset(), prefix: str = "") -> None:
    """Write ``fill``'s values into every parameter and buffer of ``module`` not in ``skip`` (by id)."""
    for name, tensor in [*module.named_parameters(prefix), *module.named_buffers(prefix)]:
        if id(tensor) not in skip:
            fill(name, tensor.data)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def comfy_forward(model: nn.Module, config: BenchConfig) -> Callable[[], Any]:
    """One ComfyUI-style model call: batch 2 (cond + uncond), 5-D latent, bf16."""
    generator = torch.Generator().manual_seed(0)
    shape = (2, 16, 1, config.height // 8, config.width // 8)
    x = torch.randn(shape, generator=generator).to(config.device, DTYPE)
    context = torch.randn(2, config.text_tokens, config.joint_dim, generator=generator).to(config.device, DTYPE)
    timestep = torch.full((2,), 0.5, device=config.device)
    return lambda: model(x, timestep, context, transformer_options={})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    with torch.inference_mode():
        for _ in range(warmup):
            step()
        synchronize(device)
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    return seconds


def device_caps(config: BenchConfig) -> list[int]:
    """The caps, each clamped to the GPU's memory (a 40 GiB cap on an A100 40G is the whole card)."""
    if config.device.type != "cuda":
        return list(config.caps_bytes)
    total = torch.cuda.get_device_properties(config.device).total_memory
    return [min(cap, total) for cap in config.caps_bytes]


@contextlib.contextmanager
def memory_cap(cap: int | None, device: torch.device) -> Iterator[None]:
    """Cap the caching allocator at ``cap`` bytes (nothing is enforced on a CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def peak_device_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_mode(result: ModeResult, step: Callable[[], Any], config: BenchConfig, meter: Any = None,
             slow: bool = False) -> ModeResult:
    """Time ``step`` under the result's cap; ``meter`` (a handle or the copy-back) fills the ledger columns.

    ``slow`` modes (the synchronous baselines) time ``slow_steps`` steps without a warm-up: they run
    after other modes in the same process, and one of their steps takes tens of seconds on a GPU.
    """
    steps, warmup = (config.slow_steps, 0) if slow else (config.steps, config.warmup)
    try:
        with memory_cap(result.cap_bytes, config.device):
            time_steps(step, config.device, warmup, 0)
            if meter is not None:
                meter.reset_stats()
            result.step_s = time_steps(step, config.device, 0, steps)
            result.peak_device_bytes = peak_device_bytes(config.device)
    except torch.cuda.OutOfMemoryError as error:
        result.skipped = f"out of memory: {str(error).splitlines()[0]}"
    if meter is not None and result.step_s:
        _read_ledger(result, meter.stats(), len(result.step_s))
    log.info("%s: %s", result.label, result.skipped or f"{result.seconds:.3f} s/step")
    return result


def _read_ledger(result: ModeResult, stats: dict[str, Any], steps: int) -> None:
    result.streamed_bytes = stats["bytes_h2d"] / steps
    result.d2h_bytes = stats["bytes_d2h"] / steps
    result.copies = stats["copies_h2d"] / steps
    result.hook_us_per_group = stats["hook_us_per_group"]
    result.compute_wait_ms = stats["compute_wait_ms"] / steps
    result.resident_groups = stats.get("resident_groups")


def measure_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s: pinned and pageable host-to-device, pinned device-to-host and into fresh pageable memory.

    On a CPU these are host copies (into existing memory, and into fresh memory for the last).
    """
    pin = device.type == "cuda"
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
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

    return {
        "h2d_pinned_gbps": best(lambda: target.copy_(pinned, non_blocking=True)),
        "h2d_pageable_gbps": best(lambda: target.copy_(pageable)),
        "d2h_pinned_gbps": best(lambda: pinned.copy_(target, non_blocking=True)),
        "d2h_fresh_pageable_gbps": best(lambda: target.to("cpu", copy=True)),
    }


@contextlib.contextmanager
def on_device(modules: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Copy every tensor of ``modules`` to ``device`` and point back at the host tensors afterwards."""
    saved = [(p, p.data) for m in modules for p in m.parameters()]
    for param, host in saved:
        param.data = host.to(device, copy=True)
    try:
        yield
    finally:
        for param, host in saved:
            param.data = host


# --------------------------------------------------------------------------------------------
# Family "pack": resident, this pack, copy-back
# --------------------------------------------------------------------------------------------

class BlockInputs:
    """The arguments of the first call of one block, kept to time that block alone."""

    def __init__(self, block: nn.Module) -> None:
        self.args: tuple | None = None
        self.kwargs: dict | None = None
        self._hook = block.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        self._hook.remove()


def _activation_reserve(result: ModeResult, before: int, slab_bytes: int) -> int:
    """Reserve for activations from a streamed run: 1.25 × its peak beyond weights and slabs, + 1 GiB."""
    if result.peak_device_bytes is None:
        return 0
    return int(1.25 * max(0, result.peak_device_bytes - before - slab_bytes)) + GIB


def _pack_modes(model: nn.Module, blocks: list[nn.Module], step: Callable[[], Any], config: BenchConfig,
                fill: RandomWeights) -> tuple[list[ModeResult], int]:
    """prefetch 0 at each cap, then prefetch 1 stream_all and auto at each cap; returns the reserve."""
    device, results = config.device, []
    handle = apply_group_offload(model, blocks, device, prefetch=0, fill=fill)
    weights_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    caps = device_caps(config)
    for cap in caps:
        results.append(run_mode(ModeResult("pack", "p0", f"pack, stream_all, prefetch 0, cap {_cap(cap)}", cap,
                                           "pinned_sync"), step, config, handle))
    reserve = _activation_reserve(results[0], weights_before, handle.stats()["slab_bytes"])
    handle.remove()
    del handle
    gc.collect()
    handle = apply_group_offload(model, blocks, device, prefetch=1)
    other = module_bytes(model) - sum(g.nbytes for g in handle.groups)
    for cap in caps:
        handle.set_resident_bytes(0)
        results.append(run_mode(ModeResult("pack", "p1", f"pack, stream_all, prefetch 1, cap {_cap(cap)}", cap,
                                           "pinned_prefetch"), step, config, handle))
        slabs = handle.device_bytes_needed()
        handle.set_resident_bytes(max(0, cap - reserve - other - slabs))
        results.append(run_mode(ModeResult("pack", "auto", f"pack, auto-like residency, prefetch 1, cap {_cap(cap)}",
                                           cap, "pinned_prefetch"), step, config, handle))
    handle.remove()
    return results, reserve


def _block_compute_s(block: nn.Module, inputs: BlockInputs, config: BenchConfig) -> float:
    """One block's forward time with its weights on the device (median)."""
    with on_device([block], config.device):
        seconds = time_steps(lambda: block(*inputs.args, **inputs.kwargs), config.device, 1, config.probe_repeats)
    return statistics.median(seconds)


def _resident_mode(model: nn.Module, blocks: list[nn.Module], step: Callable[[], Any], config: BenchConfig,
                   reserve: int) -> ModeResult:
    result = ModeResult("pack", "resident", "all resident (no offload), uncapped", None, "resident")
    device = config.device
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < module_bytes(model) + reserve:
        result.skipped = "the whole model does not fit on this GPU"
        return result
    with on_device(blocks, device):
        return run_mode(result, step, config)


def pack_family(config: BenchConfig) -> dict[str, Any]:
    device = config.device
    bandwidth = measure_bandwidth(device, GIB if device.type == "cuda" else 16 * 2**20)
    log.info("bandwidth: %s", {k: round(v, 2) for k, v in bandwidth.items()})
    import_comfy(config)
    model = build_comfy_model(config)
    blocks = list(model.transformer_blocks)
    fill = RandomWeights(config.pool_numel)
    fill_tensors(model, fill, skip={id(t) for b in blocks for t in (*b.parameters(), *b.buffers())})
    for name, module in model.named_children():
        if name != "transformer_blocks":
            module.to(device)
    step = comfy_forward(model, config)
    block_inputs = BlockInputs(blocks[0])
    results, reserve = _pack_modes(model, blocks, step, config, fill)
    block_s = _block_compute_s(blocks[0], block_inputs, config)
    results.append(_resident_mode(model, blocks, step, config, reserve))
    cap = min(device_caps(config))
    baseline = CopyBackOffload(blocks, device)
    results.append(run_mode(ModeResult("pack", "copy_back", f"copy-back baseline, cap {_cap(cap)}", cap, "copy_back"),
                            step, config, baseline, slow=True))
    baseline.remove()
    return {"bandwidth": bandwidth, "activation_reserve": reserve, "block_compute_s": block_s,
            "model_bytes": module_bytes(model), "results": [asdict(r) for r in results]}


# --------------------------------------------------------------------------------------------
# Family "comfy": ComfyUI core partial loading
# --------------------------------------------------------------------------------------------

def comfy_family(config: BenchConfig) -> dict[str, Any]:
    """ModelPatcher lowvram at each cap, smallest first, growing with ``partially_load`` as ComfyUI does."""
    import_comfy(config)
    from comfy.model_patcher import ModelPatcher

    device = config.device
    model = build_comfy_model(config)
    fill_tensors(model, RandomWeights(config.pool_numel))
    patcher = ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))
    step = comfy_forward(model, config)
    reserve = config.activation_reserve or 0
    total, results, budget_loaded = module_bytes(model), [], 0
    for cap in sorted(device_caps(config)):
        budget = max(1, cap - reserve)
        if budget_loaded == 0:
            patcher.patch_model(device_to=device, lowvram_model_memory=budget)
        else:
            patcher.partially_load(device, extra_memory=budget - budget_loaded)
        budget_loaded = budget
        result = ModeResult("comfy", "partial", f"ComfyUI partial load (lowvram, pinned, async), cap {_cap(cap)}",
                            cap, "comfy_async")
        result.streamed_bytes = float(total - model.model_loaded_weight_memory)
        results.append(run_mode(result, step, config))
    return {"results": [asdict(r) for r in results]}


# --------------------------------------------------------------------------------------------
# Family "diffusers": its own group offloading
# --------------------------------------------------------------------------------------------

def build_diffusers_model(config: BenchConfig, fill: RandomWeights) -> nn.Module:
    from comfy_env import qwen_rope_axes
    from diffusers import QwenImageTransformer2DModel

    dims = dict(num_layers=config.blocks, attention_head_dim=config.head_dim, num_attention_heads=config.heads,
                joint_attention_dim=config.joint_dim, axes_dims_rope=qwen_rope_axes(config.head_dim))
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**dims)
    # Its RoPE frequency tables are plain attributes, not buffers: build that module for real.
    model.pos_embed = type(model.pos_embed)(theta=10000, axes_dim=list(dims["axes_dims_rope"]), scale_rope=True)
    model = model.to(DTYPE).to_empty(device="cpu").eval().requires_grad_(False)
    fill_tensors(model, fill)
    return model


def diffusers_forward(model: nn.Module, config: BenchConfig) -> Callable[[], Any]:
    """The same call as :func:`comfy_forward` in diffusers' terms (packed latents, img_shapes)."""
    generator = torch.Generator().manual_seed(0)
    grid = (config.height // 16, config.width // 16)
    latents = torch.randn(2, grid[0] * grid[1], 64, generator=generator).to(config.device, DTYPE)
    context = torch.randn(2, config.text_tokens, config.joint_dim, generator=generator).to(config.device, DTYPE)
    kwargs = dict(hidden_states=latents, encoder_hidden_states=context, timestep=torch.full((2,), 0.5, device=config.device, dtype=DTYPE),
                  encoder_hidden_states_mask=torch.ones(2, config.text_tokens, dtype=torch.long, device=config.device),
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


def diffusers_family(config: BenchConfig) -> dict[str, Any]:
    cap = min(device_caps(config))
    modes = [(False, "pageable_sync"), (True, "pinned_prefetch")]
    results = [ModeResult("diffusers", f"use_stream={use_stream}",
                          f"diffusers group offload, use_stream={use_stream}, cap {_cap(cap)}", cap, transfer)
               for use_stream, transfer in modes]
    missing = _diffusers_missing()
    if missing:
        for result in results:
            result.skipped = missing
        return {"results": [asdict(r) for r in results]}
    fill = RandomWeights(config.pool_numel)
    for (use_stream, _), result in zip(modes, results):
        if use_stream and config.device.type != "cuda":
            result.skipped = "use_stream needs CUDA streams"
            continue
        model = build_diffusers_model(config, fill)
        model.enable_group_offload(onload_device=config.device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream)
        result.streamed_bytes = float(module_bytes(model))
        result.d2h_bytes = 0.0 if use_stream else result.streamed_bytes
        run_mode(result, diffusers_forward(model, config), config, slow=not use_stream)
        del model
        gc.collect()
        if config.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"results": [asdict(r) for r in results]}


WORKERS: dict[str, Callable[[BenchConfig], dict[str, Any]]] = {
    "pack": pack_family, "comfy": comfy_family, "diffusers": diffusers_family}


# --------------------------------------------------------------------------------------------
# Parent: run the families, derive the figures, write the results
# --------------------------------------------------------------------------------------------

def _cap(cap: int | None) -> str:
    return "none" if cap is None else f"{cap / GIB:.1f} GiB" if cap >= GIB else f"{cap / 2**20:.1f} MiB (virtual)"


def run_family(family: str, config: BenchConfig, timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", family, "--config", json.dumps(asdict(config))]
    log.info("family %s (timeout %.0f s)", family, timeout)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        log.error("family %s failed (exit %d):\n%s", family, done.returncode, done.stderr[-4000:])
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"}
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def _compute_seconds(pack: dict[str, Any], config: BenchConfig) -> tuple[float | None, str]:
    resident = next((r for r in pack.get("results", []) if r["mode"] == "resident" and r["step_s"]), None)
    if resident is not None:
        return statistics.median(resident["step_s"]), "resident run"
    if "block_compute_s" in pack:
        return pack["block_compute_s"] * config.blocks, f"{config.blocks} × one resident block"
    return None, "not measured"


def derive(rows: list[dict[str, Any]], bandwidth: dict[str, float], compute_s: float | None) -> list[dict[str, Any]]:
    """Ratio to resident, GB/s, step ÷ bound, and the cost model's estimate, per measured mode."""
    resident = next((r for r in rows if r["mode"] == "resident" and r["step_s"]), None)
    resident_s = statistics.median(resident["step_s"]) if resident else None
    pinned = bandwidth.get("h2d_pinned_gbps")
    out = []
    for row in rows:
        seconds = statistics.median(row["step_s"]) if row["step_s"] else None
        derived = {"seconds": seconds, "ratio_to_resident": None, "achieved_gbps": None, "vs_bound": None, "model_s": None}
        if seconds is not None:
            streamed = row["streamed_bytes"]
            derived["ratio_to_resident"] = seconds / resident_s if resident_s else None
            derived["achieved_gbps"] = streamed / seconds / 1e9 if streamed else None
            if compute_s is not None and pinned:
                derived["vs_bound"] = seconds / max(compute_s, streamed / (pinned * 1e9))
                derived["model_s"] = _model_seconds(row, bandwidth, compute_s)
        out.append({**row, **derived})
    return out


def _model_seconds(row: dict[str, Any], bandwidth: dict[str, float], compute_s: float) -> float:
    """``offload_core.cost_model.pass_seconds`` with the measured compute time and bandwidths."""
    pageable = row["transfer"] in ("copy_back", "pageable_sync")
    h2d = bandwidth["h2d_pageable_gbps" if pageable else "h2d_pinned_gbps"]
    overlap = row["transfer"] in ("pinned_prefetch", "comfy_async")
    return pass_seconds(compute_s, row["streamed_bytes"], h2d, row["d2h_bytes"],
                        bandwidth["d2h_fresh_pageable_gbps"], overlap=overlap)


def results_markdown(rows: list[dict[str, Any]], bandwidth: dict[str, float], compute: tuple[float | None, str],
                     header: str, smoke: bool) -> str:
    bw = ", ".join(f"{k.removesuffix('_gbps').replace('_', ' ')} {v:.2f}" for k, v in bandwidth.items())
    unit, scale = ("MB", 1e6) if smoke else ("GB", 1e9)
    headers = ["mode", "s/step", "× resident", f"streamed {unit}/step", "achieved GB/s", "step ÷ max(compute, bytes ÷ bw)",
               "cost model s/step", "copies/step", "hook µs/group", "GPU wait ms/step", "resident groups",
               "peak GiB allocated", "note"]
    table = [[r["label"], fmt(r["seconds"], 3), fmt(r["ratio_to_resident"]), fmt(r["streamed_bytes"] / scale),
              fmt(r["achieved_gbps"], 1), fmt(r["vs_bound"]), fmt(r["model_s"], 3), fmt(r["copies"], 0),
              fmt(r["hook_us_per_group"], 0), fmt(r["compute_wait_ms"], 1),
              "—" if r["resident_groups"] is None else str(r["resident_groups"]),
              fmt(None if r["peak_device_bytes"] is None else r["peak_device_bytes"] / GIB, 1),
              r["skipped"] or ""] for r in rows]
    seconds, source = compute
    return (f"{header}\n\nBandwidth (GB/s): {bw}. Compute time per step: {fmt(seconds, 3)} s ({source}).\n\n"
            + markdown_table(headers, table))


def environment(config: BenchConfig) -> str:
    if config.device.type == "cuda":
        props = torch.cuda.get_device_properties(config.device)
        gpu = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        gpu = "no GPU: --smoke on the CPU (caps are virtual, bandwidths are host copies)"
    width = config.heads * config.head_dim
    return (f"{gpu}; torch {torch.__version__}, Python {platform.python_version()}; "
            f"{config.blocks} blocks × width {width}, {config.width}×{config.height}, {config.text_tokens} text tokens, "
            f"batch 2 (cond + uncond in one pass), {config.steps} timed steps after {config.warmup} warm-up "
            f"({config.slow_steps} for the synchronous baselines); {time.strftime('%Y-%m-%d %H:%M')}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: the same code paths, quickly")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO_ROOT / ".artifacts" / "gpu"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget for all families (s)")
    parser.add_argument("--worker", choices=FAMILIES, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if args.worker:
        raw = json.loads(args.config)
        config = BenchConfig(**{**raw, "caps_bytes": tuple(raw["caps_bytes"])})
        print(RESULT_PREFIX + json.dumps(WORKERS[args.worker](config)), flush=True)
        return 0

    config = smoke_config() if args.smoke else BenchConfig()
    if not args.smoke and not torch.cuda.is_available():
        log.error("no CUDA device: this benchmark needs one (use --smoke to check its code paths on the CPU)")
        return 2
    started, families = time.monotonic(), {}
    for family in args.families.split(","):
        left = args.budget_s - (time.monotonic() - started)
        if left < 30:
            families[family] = {"error": "skipped: the time budget is spent"}
            continue
        families[family] = run_family(family, config, left)
        if family == "pack" and "activation_reserve" in families[family]:
            config = dataclasses.replace(config, activation_reserve=families[family]["activation_reserve"])
    return write_results(config, families, time.monotonic() - started, args.out)


def write_results(config: BenchConfig, families: dict[str, dict[str, Any]], seconds: float, out: Path) -> int:
    pack = families.get("pack", {})
    bandwidth = pack.get("bandwidth", {})
    compute = _compute_seconds(pack, config)
    rows = derive([r for f in families.values() for r in f.get("results", [])], bandwidth, compute[0])
    errors = {name: f["error"] for name, f in families.items() if "error" in f}
    header = f"{environment(config)}; {seconds:.0f} s in all." + "".join(
        f"\n\nFamily {name}: {error}" for name, error in errors.items())
    markdown = results_markdown(rows, bandwidth, compute, header, config.smoke)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_results.json").write_text(json.dumps(
        {"config": asdict(config), "families": families, "rows": rows, "seconds": seconds}, indent=1))
    (out / "gpu_results.md").write_text(markdown + "\n")
    print(markdown)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
