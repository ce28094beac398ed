"""Bare forwards of the same model outside ComfyUI's sampler: the copy-back baseline (diffusers' group
offloading before the fix) and diffusers' own group offloading, ``use_stream`` False and True."""
from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from copy_back import CopyBackOffload
from testbed.host_memory import peak_rss_bytes, reset_peak

from ..balloon import Balloon
from ..comfyui import start_comfyui
from ..config import ROWS, BenchConfig, Row
from ..sampling import end_row
from ..timing import synchronize
from ..weights import RandomWeights, comfy_qwen_on_meta, fill_module


def bare_forward(model: nn.Module, config: BenchConfig) -> Callable[[], Any]:
    """One ComfyUI-style model call: batch 2 (cond + uncond), 5-D latent, bf16."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((2, 16, 1, config.height // 8, config.width // 8), generator=generator).to(config.device, torch.bfloat16)
    context = torch.randn(2, config.text_tokens, config.joint_dim, generator=generator).to(config.device, torch.bfloat16)
    timestep = torch.full((2,), 0.5, device=config.device)
    return lambda: model(x, timestep, context, transformer_options={})


def time_bare(row: Row, step: Callable[[], Any], config: BenchConfig, balloon: Balloon, meter: Any = None) -> Row:
    """One timed call, without a warm-up: a baseline call takes tens of seconds, mostly copies."""
    if not ROWS.begin(row, config):
        return row
    try:
        balloon.set_cap(row.cap_bytes)
        reset_peak()
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
    end_row(row)
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
    from testbed.fixture_models import qwen_rope_axes
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
        if not ROWS.begin(row, config):
            continue
        row.skipped = _diffusers_missing() or (None if config.device.type == "cuda" or not use_stream
                                               else "use_stream needs CUDA streams")
        if row.skipped:
            end_row(row)
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
