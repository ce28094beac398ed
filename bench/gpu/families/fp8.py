"""An fp8 (e4m3fn) checkpoint: newest ComfyUI as shipped against this pack."""
from __future__ import annotations

from pathlib import Path

import torch

from ..balloon import Balloon
from ..comfyui import comfy_system, load_comfy_model, start_comfyui
from ..config import BenchConfig, Row
from ..sampling import OFFLOAD_ROWS, comfy_rows, offload_rows, sample_row


def fp8_family(config: BenchConfig, out: Path) -> None:
    """An fp8 (e4m3fn) checkpoint, newest ComfyUI as shipped against this pack."""
    patcher = start_comfyui(config, dynamic=True)
    balloon = Balloon(config.device)
    plain = load_comfy_model(config, torch.float8_e4m3fn, dynamic_patcher=True)
    system = comfy_system(patcher)
    comfy_rows("fp8", system, plain, config, balloon, "fp8", config.fp8_caps_bytes)
    sample_row(Row("fp8", "all resident", "resident", "fp8", None), plain, config, balloon)
    for cap in config.fp8_caps_bytes:
        offload_rows("fp8", plain, config, balloon, "fp8", cap, OFFLOAD_ROWS[:2], None)
