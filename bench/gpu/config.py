"""What a GPU benchmark run is made of: its configuration, its rows, and the ``RESULT`` line a row ends with."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
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
    legacy_caps_bytes: tuple[int, ...] = (24 * GIB, 16 * GIB)
    gguf_caps_bytes: dict[str, tuple[int, ...]] = field(default_factory=lambda: {"Q8_0": (8 * GIB, 12 * GIB),
                                                                                  "Q4_K": (8 * GIB,)})
    compile_blocks: int = 20  # 13.6 GB in bf16: cold inductor compiles stay short
    compile_cap_bytes: int = 12 * GIB  # about half of the 20 blocks stream
    # TorchCompileModel's backend. --smoke takes aot_eager: dynamo traces the same graphs through the same hooks
    # (every row's code path), without inductor's cold C++ compile on the CPU, seconds instead of a minute a row;
    # inductor on the pack's hooks is tested in tests/nodes/test_compile.py.
    compile_backend: str = "inductor"
    box_blocks: int = 60  # the box family's fp8 file: 60 blocks are full-size Qwen-Image, 20.4 GB
    # (RAM, card) pairs of the user's machines: 32 GB with a 16 GiB card, 16 GB with a 12 GiB card.
    box_machines: tuple[tuple[int, int], ...] = ((32 * GIB, 16 * GIB), (16 * GIB, 12 * GIB))
    box_os_bytes: int = 3 * GIB  # what the OS and desktop hold on such a machine, beside ComfyUI
    # The text-encoder family's Qwen2.5-VL-7B: its real widths (te_tiny: the test bed's tiny ones), te_layers of its
    # 28 (ComfyUI builds 28 from a full-width file: fewer would leave layers unloaded), bf16, at te_cap_bytes;
    # te_prompts (at most 3: the family's PROMPTS) steady encodes and as many prompt changes after the first.
    te_tiny: bool = False
    te_layers: int = 28
    te_cap_bytes: int = 12 * GIB
    te_prompts: int = 3
    steps: int = 2  # timed, after one warm-up step
    row_limit_s: float = 60.0  # a row stops after the step that passes it (the steps so far are kept)
    lora_rank: int = 16
    pool_numel: int = 1 << 24  # random values tiled into the weights

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.smoke else "cuda")


def smoke_config() -> BenchConfig:
    """Three blocks of width 64 at 64×64 on the CPU; the caps are labels only (nothing is enforced); torch.compile
    without inductor (``compile_backend``); the test bed's tiny Qwen2.5-VL-7B of 2 layers."""
    return BenchConfig(smoke=True, blocks=3, heads=2, head_dim=32, joint_dim=64, width=64, height=64,
                       text_tokens=8, steps=2, pool_numel=1 << 12, caps_bytes=(2 * 2**20, 2**20),
                       fp8_caps_bytes=(2**20,), legacy_caps_bytes=(2 * 2**20, 2**20),
                       gguf_caps_bytes={"Q8_0": (2**20, 2 * 2**20), "Q4_K": (2**20,)}, compile_blocks=2,
                       compile_cap_bytes=2**20, compile_backend="aot_eager", box_blocks=3,
                       box_machines=((32 * GIB, 2 * 2**20), (16 * GIB, 2**20)), te_tiny=True, te_layers=2,
                       te_cap_bytes=2**20, te_prompts=2)


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
    read_bytes: float | None = None  # read from storage per timed step (/proc/self/io)
    load_s: float | None = None  # the loader node's time, where the row loads a file (box)
    second_first_step_s: float | None = None  # the first step of a second generation queued after the first (box)
    disk_bytes: float | None = None  # this pack's gathered_from_disk_bytes per timed step
    change_s: list[float] = field(default_factory=list)  # the text encoder's encodes after a prompt change
    peak_anon_bytes: int | None = None  # the peak anonymous memory above the process's before the load
    max_abs_diff: float | None = None  # the text encoder's conditioning against ComfyUI's (max |Δ|)
    note: str = ""
    skipped: str | None = None
    index: int | None = None  # the row's place in its family, set as it begins (begin_row)
    limit_s: float | None = None  # wall-clock limit from its start to its RESULT line; None: the config's


    @property
    def seconds(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None


def emit(kind: str, payload: dict[str, Any]) -> None:
    """One line for the parent: a row as it begins and the moment it ends, or a fact about the family."""
    print(RESULT_PREFIX + json.dumps({"kind": kind, **payload}), flush=True)


class RowCounter:
    """Numbers a family's rows as they begin. A family's process started again after a row that failed or ran
    out of time (``--skip``) passes over the rows before it: the parent has their RESULT lines already."""

    def __init__(self) -> None:
        self.skip, self.count = 0, 0

    def begin(self, row: Row, config: BenchConfig) -> bool:
        """Number ``row`` and tell the parent it began, with its limit; False (and ``row.skipped`` set) for a
        row an earlier process of the family reported."""
        if row.index is not None:
            return row.skipped is None
        row.index, self.count = self.count, self.count + 1
        if row.index < self.skip:
            row.skipped = "reported by an earlier process of its family"
            return False
        row.limit_s = row.limit_s or config.row_limit_s + LOAD_ALLOWANCE_S
        emit("start", asdict(row))
        return True


# What a row may take beyond its sampling limit: the load, the warm-up step.
LOAD_ALLOWANCE_S = 60.0
ROWS = RowCounter()


def cap_label(cap: int | None) -> str:
    return "whole card" if cap is None else f"{cap / GIB:.0f} GiB" if cap >= GIB else f"{cap / 2**20:.0f} MiB"


def config_from_json(raw: dict[str, Any]) -> BenchConfig:
    """The config a worker was given (``asdict`` through JSON: its tuples came back as lists)."""
    def tuples(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(tuples(v) for v in value)
        if isinstance(value, dict):
            return {k: tuples(v) for k, v in value.items()}
        return value

    return BenchConfig(**{k: tuples(v) for k, v in raw.items()})
