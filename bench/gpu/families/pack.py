"""This pack's node on the model newest ComfyUI loaded (Dynamic VRAM), bf16: ``auto`` and ``stream_all`` at each
cap, one profiled step, and the rows of the host side (pins refused, pins capped, a host budget)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..balloon import Balloon
from ..comfyui import load_comfy_model, start_comfyui
from ..config import GIB, ROWS, BenchConfig, Row, emit
from ..sampling import OFFLOAD_ROWS, end_row, offload_handle, offload_node, offload_row, offload_rows, sample_row
from ..timing import measure_bandwidth


def pageable_row(family: str, plain: Any, config: BenchConfig, balloon: Balloon, cap: int,
                 pinned_share: float = 0.0) -> None:
    """``stream_all`` prefetch 1 under a pinned-memory limit of ``pinned_share`` of the model: with none
    (``--disable-pinned-memory``) every mirror stays pageable; with some (Windows past its limit) the
    groups past it stream through the pinned staging ring."""
    import comfy.model_management as mm

    mode = ("stream_all p1, pins refused" if not pinned_share else
            f"stream_all p1, pins capped at {pinned_share:.0%} (staging ring)")
    row = Row(family, "this pack", mode, "bf16", cap)
    if not ROWS.begin(row, config):
        return
    if pinned_share and config.device.type != "cuda":
        row.skipped = "needs CUDA: ComfyUI pins nothing under --cpu"
        end_row(row)
        return
    offloaded = offload_node(plain, {"residency": "stream_all", "prefetch": 1})
    handle = offload_handle(offloaded)
    if handle is not None:
        handle.unpin()
    limit, mm.MAX_PINNED_MEMORY = mm.MAX_PINNED_MEMORY, int(pinned_share * plain.model_size())
    try:
        sample_row(row, offloaded, config, balloon)
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
        offload_rows("pack", plain, config, balloon, "bf16", cap, OFFLOAD_ROWS, out if cap == smallest else None)
    pageable_row("pack", plain, config, balloon, smallest)
    pageable_row("pack", plain, config, balloon, smallest, pinned_share=0.5)
    host_budget_row("pack", plain, config, balloon, smallest)


def auto_family(config: BenchConfig, out: Path) -> None:
    """``auto`` after the batching fix (issue 33, item 1): this pack's node with ``auto`` on the model newest ComfyUI
    loaded (Dynamic VRAM), bf16, at each cap, the smallest first and its first timed step profiled; beside the
    ``shipped`` family's rows of the same call."""
    start_comfyui(config, dynamic=True)
    balloon = Balloon(config.device)
    plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
    smallest = min(config.caps_bytes)
    for cap in sorted(config.caps_bytes):
        offload_row(Row("auto", "this pack", "auto", "bf16", cap), plain, dict(OFFLOAD_ROWS)["auto"], config, balloon,
                    out if cap == smallest else None)
