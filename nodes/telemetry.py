"""Live offload figures for the UI, and the statistics of the last sampling run.

Between ``start_run`` and ``finish_run`` (the patcher's ``pre_run`` and ``cleanup``) the handle's
ledger figures are read once per sampling step — never per block, and without reading anything back from the
GPU: ``step_done`` runs as a ComfyUI post-CFG function, once per denoising evaluation — and at most
``MAX_MESSAGES_PER_SECOND`` websocket messages are sent.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..offload_core import GroupOffloadHandle, packed_nbytes
from .model_state import state_of

EVENT = "group_offload.telemetry"
MAX_MESSAGES_PER_SECOND = 4
MAX_STEPS_SHOWN = 64


@dataclass
class StepSample:
    bytes_h2d: int
    seconds: float
    gathered_bytes: int = 0  # of the groups left in place: gathered into the pinned staging buffers

    @property
    def gbps(self) -> float:
        return self.bytes_h2d / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class RunTelemetry:
    handle: GroupOffloadHandle
    node_id: str | None
    cpu_only: bool
    formats: list[tuple[str, int]] = field(default_factory=list)
    host_dequantized_bytes: int = 0
    steps: list[StepSample] = field(default_factory=list)
    # (perf_counter, ledger bytes_h2d, ledger gathered_bytes) where the open step began: the run's start, then
    # the previous step's end.
    _step_start: tuple[float, int, int] = field(default_factory=lambda: (time.perf_counter(), 0, 0))
    _last_sent: float | None = None
    host_limit: str | None = None  # the limit that bound the host budget (``handles.host_limit``)
    left_whole: list[tuple[str, int]] = field(default_factory=list)  # text encoders loaded as ComfyUI loads them

    def on_step(self) -> None:
        """A denoising step has ended: close it, and send the figures unless one was sent just now."""
        figures = self.handle.ledger_figures()
        now, sent, gathered = time.perf_counter(), figures["bytes_h2d"], figures["gathered_bytes"]
        start, start_sent, start_gathered = self._step_start
        self.steps.append(StepSample(sent - start_sent, now - start, gathered - start_gathered))
        self._step_start = (now, sent, gathered)
        if self._last_sent is None or now - self._last_sent >= 1.0 / MAX_MESSAGES_PER_SECOND:
            self._last_sent = now
            send(self.payload(final=False))

    def finish(self) -> dict[str, Any]:
        payload = self.payload(final=True)
        send(payload)
        return payload

    def payload(self, final: bool) -> dict[str, Any]:
        return telemetry_payload(self.handle.stats(), self.steps, self.node_id, self.cpu_only, final, self.formats,
                                 self.host_dequantized_bytes, self.host_limit, self.left_whole)


def telemetry_payload(stats: dict[str, Any], steps: list[StepSample], node_id: str | None,
                      cpu_only: bool, final: bool, formats: list[tuple[str, int]] = (),
                      host_dequantized_bytes: int = 0, host_limit: str | None = None,
                      left_whole: list[tuple[str, int]] = ()) -> dict[str, Any]:
    """The message the front end draws: the handle's figures plus the per-step streamed GB/s; the quantized
    formats the blocks are stored in (``quantized_formats``) and the bytes of them dequantized on the host
    (``host_dequantized_bytes``); and, when groups are left in place, where their host copies are, how fast
    they were gathered, how much of them stays in the page cache, and the limit that bound the host budget; for a
    text encoder, the encoders beside it that load whole (``left_whole``: name, bytes)."""
    seconds = sum(s.seconds for s in steps)
    streamed = sum(s.bytes_h2d for s in steps)
    gathered = sum(s.gathered_bytes for s in steps)
    return {
        "node_id": node_id,
        "final": final,
        "cpu_only": cpu_only,
        "groups": stats["groups"],
        "resident_groups": stats["resident_groups"],
        "streamed_groups": stats["groups"] - stats["resident_groups"],
        "prefetch": stats["prefetch"],
        "back_offs": stats["back_offs"],
        "resident_bytes": stats["resident_bytes"],
        "streamed_bytes_per_pass": stats["streamed_bytes_per_pass"],
        "pinned_bytes": stats["pinned_bytes"],
        "host_bytes": stats["host_bytes"],
        "bytes_h2d": stats["bytes_h2d"],
        "bytes_d2h": stats["bytes_d2h"],
        "copies_h2d": stats["copies_h2d"],
        "onloads": stats["onloads"],
        "sync_onloads": stats["sync_onloads"],
        "compute_wait_ms": stats["compute_wait_ms"],
        "hook_us_per_group": stats["hook_us_per_group"],
        "formats": [list(item) for item in formats],
        "host_dequantized_bytes_per_pass": host_dequantized_bytes,
        "steps": len(steps),
        "bytes_per_step": streamed / len(steps) if steps else 0.0,
        "h2d_gbps": streamed / seconds / 1e9 if seconds > 0 else 0.0,
        "step_gbps": [round(s.gbps, 3) for s in steps[-MAX_STEPS_SHOWN:]],
        "packed_bytes": stats["packed_bytes"],
        "in_place_bytes": stats["in_place_bytes"],
        "file_backed_bytes": stats["file_backed_bytes"],
        "kept_cached_bytes": stats["kept_cached_bytes"],
        "host_limit": host_limit,
        "gathered_bytes": stats["gathered_bytes"],
        "gathered_from_disk_bytes": stats["gathered_from_disk_bytes"],
        "gathered_bytes_per_step": gathered / len(steps) if steps else 0.0,
        "gather_gbps": stats["gathered_bytes"] / stats["gather_seconds"] / 1e9 if stats["gather_seconds"] > 0 else 0.0,
        "read_ahead": stats["read_ahead"],
        "left_whole": [list(item) for item in left_whole],
    }


def quantized_formats(handle: GroupOffloadHandle) -> list[tuple[str, int]]:
    """The blocks' bytes by the quantized format they are stored in, largest first: a GGUF type (ComfyUI-GGUF's
    ``tensor_type``, ``GGUF Q4_K``) or a quantized tensor's layout; plain tensors are not listed."""
    totals: dict[str, int] = {}
    for tensor in handle.block_tensors():
        name = _quantized_format(tensor)
        if name is not None:
            totals[name] = totals.get(name, 0) + packed_nbytes(tensor)
    return sorted(totals.items(), key=lambda item: -item[1])


def host_dequantized_bytes(handle: GroupOffloadHandle) -> int:
    """The blocks' bytes that their layers dequantize on the host, each weight copied there at every forward and
    back: the GGUF types ComfyUI-GGUF has no torch dequantizer for (it falls back to gguf-py's numpy code)."""
    return sum(packed_nbytes(tensor) for tensor in handle.block_tensors() if _dequantized_on_the_host(tensor))


def _dequantized_on_the_host(tensor: torch.Tensor) -> bool:
    gguf_type = getattr(tensor, "tensor_type", None)
    if gguf_type is None or torch.Tensor.dtype.__get__(tensor).is_floating_point:  # (F32, F16: torch's own)
        return False
    package = type(tensor).__module__.rpartition(".")[0]  # the dequantizers of the custom node that made the tensor
    on_the_device = getattr(sys.modules.get(f"{package}.dequant"), "dequantize_functions", None)
    return on_the_device is not None and gguf_type not in on_the_device


def _quantized_format(tensor: torch.Tensor) -> str | None:
    gguf_type = getattr(tensor, "tensor_type", None)
    if gguf_type is not None:
        return f"GGUF {getattr(gguf_type, 'name', gguf_type)}"
    layout = getattr(tensor, "_layout_cls", None) or getattr(tensor, "_layout_type", None)
    return None if layout is None else str(getattr(layout, "__name__", layout))


def send(payload: dict[str, Any]) -> None:
    """Push ``payload`` to the client that queued the prompt (no-op without a running server)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    instance = getattr(PromptServer, "instance", None)
    if instance is not None:
        instance.send_sync(EVENT, payload, instance.client_id)


def start_run(model: nn.Module, handle: GroupOffloadHandle, node_id: str | None, cpu_only: bool,
              host_limit: str | None = None, left_whole: list[tuple[str, int]] = ()) -> None:
    """Open a sampling run (or an encode) of ``model`` (a patcher's ``model``), closing the one still open."""
    finish_run(model)
    handle.reset_stats()
    state_of(model).run = RunTelemetry(handle, node_id, cpu_only, quantized_formats(handle),
                                       host_dequantized_bytes(handle), host_limit=host_limit,
                                       left_whole=list(left_whole))


def step_done(model: nn.Module) -> None:
    run = state_of(model).run
    if run is not None:
        run.on_step()


def post_cfg_step(args: dict[str, Any]) -> torch.Tensor:
    """A ComfyUI ``sampler_post_cfg_function``: marks the end of a step, returns the result unchanged."""
    step_done(args["model"])
    return args["denoised"]


def finish_run(model: nn.Module) -> dict[str, Any] | None:
    """Close the open sampling run of this model, if any; returns its final figures."""
    state = state_of(model)
    run, state.run = state.run, None
    if run is None:
        return None
    state.last_run = run.finish()
    return state.last_run


def last_run(model: nn.Module) -> dict[str, Any] | None:
    """The final figures of the last sampling run of this model, if any."""
    return state_of(model).last_run
