"""ComfyUI started with ``--disable-dynamic-vram``: its legacy partial load (pinned, async offload streams)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..balloon import Balloon
from ..comfyui import load_comfy_model, start_comfyui
from ..config import BenchConfig
from ..sampling import comfy_rows


def legacy_family(config: BenchConfig, out: Path) -> None:
    """ComfyUI with --disable-dynamic-vram: its legacy partial load (pinned, async offload streams)."""
    start_comfyui(config, dynamic=False)
    model = load_comfy_model(config, torch.bfloat16, dynamic_patcher=False)
    # 40 GiB was measured on the H200 already (the whole model fits); 24 and 16 GiB: the --disable-dynamic-vram
    # and AMD story in two points
    comfy_rows("legacy", "ComfyUI legacy", model, config, Balloon(config.device), "bf16", config.legacy_caps_bytes)
