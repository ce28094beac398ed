"""What a GPU benchmark run is made of: its configuration, its rows, and the ``RESULT`` line a row ends with."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 2**30
RESULT_PREFIX = "RESULT "


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


def cap_label(cap: int | None) -> str:
    return "whole card" if cap is None else f"{cap / GIB:.0f} GiB" if cap >= GIB else f"{cap / 2**20:.0f} MiB"
