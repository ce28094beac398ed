"""torch.compile (issue 33, item 2): a Qwen-Image of ``compile_blocks`` blocks (20: 13.6 GB, so that cold inductor
compiles stay short) at a cap where about half the blocks stream, each system in a process of its own:

- ``compile-dynamic``      ComfyUI as shipped, Dynamic VRAM, eager: the reference;
- ``compile-comfy-eager``  the model TorchCompileModel hands on, before compiling: ``clone(disable_dynamic=True)``,
                           ComfyUI's legacy partial load (what compiling leaves Dynamic VRAM for);
- ``compile-comfy``        ComfyUI's TorchCompileModel as shipped (inductor; ``--smoke``: aot_eager, see config);
- ``compile-pack-after``   this pack's node (``auto``), then TorchCompileModel; its first timed step is profiled;
- ``compile-pack-before``  TorchCompileModel, then this pack's node.

The first step holds the load and the compile: the results give it less the steady step (the eager rows' same
figure is their load alone), so that the compile time stands apart from the step time."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..balloon import Balloon
from ..comfyui import comfy_system, load_comfy_model, start_comfyui
from ..config import ROWS, BenchConfig, Row
from ..sampling import OFFLOAD_ROWS, end_row, offload_node, sample_row

PACK_SETTINGS = dict(OFFLOAD_ROWS)["auto"]


def _compiled(model: Any, backend: str) -> Any:
    from testbed.run_nodes import run_node

    return run_node("TorchCompileModel", model=model, backend=backend).outputs[0]


def _legacy_clone(model: Any) -> Any:
    """What TorchCompileModel compiles: the model cloned off Dynamic VRAM (where ``clone`` takes the switch)."""
    if "disable_dynamic" in inspect.signature(model.clone).parameters:
        return model.clone(disable_dynamic=True)
    return model.clone()


# system: (its label, its mode, how it is built from ComfyUI's model and TorchCompileModel's backend)
SYSTEMS: dict[str, tuple[str, str, Callable[[Any, str], Any]]] = {
    "compile-dynamic": ("ComfyUI as shipped", "eager", lambda plain, backend: plain),
    "compile-comfy-eager": ("ComfyUI TorchCompileModel path", "eager (legacy partial load)",
                            lambda plain, backend: _legacy_clone(plain)),
    "compile-comfy": ("ComfyUI TorchCompileModel path", "compiled ({backend})", _compiled),
    "compile-pack-after": ("this pack", "auto, then TorchCompileModel",
                           lambda plain, backend: _compiled(offload_node(plain, PACK_SETTINGS), backend)),
    "compile-pack-before": ("this pack", "TorchCompileModel, then auto",
                            lambda plain, backend: offload_node(_compiled(plain, backend), PACK_SETTINGS)),
}
COMPILE_SYSTEMS = tuple(SYSTEMS)
PROFILED = "compile-pack-after"


def compile_family(system: str) -> Callable[[BenchConfig, Path], None]:
    label, mode, build = SYSTEMS[system]

    def run(config: BenchConfig, out: Path) -> None:
        patcher = start_comfyui(config, dynamic=True)
        config = replace(config, blocks=config.compile_blocks)
        row = Row(system, comfy_system(patcher) if label == "ComfyUI as shipped" else label,
                  mode.format(backend=config.compile_backend), f"bf16, {config.blocks} blocks", config.compile_cap_bytes)
        if not ROWS.begin(row, config):
            return
        plain = load_comfy_model(config, torch.bfloat16, dynamic_patcher=True)
        try:
            model = build(plain, config.compile_backend)
        except ValueError as error:  # a node refused the model: the row says why
            row.skipped = f"refused: {error}"
            end_row(row)
            return
        sample_row(row, model, config, Balloon(config.device), out if system == PROFILED else None)
    return run
