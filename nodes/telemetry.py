"""Live offload figures for the UI, and the statistics of the last sampling run.

Between ``start_run`` and ``finish_run`` (the patcher's ``pre_run`` and ``cleanup``) a forward hook on
the diffusion model reads the engine's ledger once per model call — never per block — groups the
figures by sampling step (a step ends when the timestep changes) and sends at most
``MAX_MESSAGES_PER_SECOND`` websocket messages.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..offload_core import GroupOffloadHandle

log = logging.getLogger(__name__)

EVENT = "group_offload.telemetry"
MAX_MESSAGES_PER_SECOND = 4
MAX_STEPS_SHOWN = 64


@dataclass
class StepSample:
    bytes_h2d: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_h2d / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class RunTelemetry:
    handle: GroupOffloadHandle
    node_id: str | None
    cpu_only: bool
    steps: list[StepSample] = field(default_factory=list)
    _step_key: float | None = None
    # (perf_counter, ledger bytes_h2d) where the open step began: the run's start, then the end of
    # the previous step's last model call.
    _step_start: tuple[float, int] = field(default_factory=lambda: (time.perf_counter(), 0))
    _last_call: tuple[float, int] | None = None  # the same, at the end of the latest model call
    _last_sent: float | None = None

    def on_forward(self, timestep: float | None) -> None:
        """After each model call: a call with a new timestep closes the step of the calls before it."""
        end = (time.perf_counter(), self.handle.ledger.bytes_h2d)
        if self._last_call is not None and timestep != self._step_key:
            self._close_step(self._last_call)
        self._step_key, self._last_call = timestep, end
        if self._last_sent is None or end[0] - self._last_sent >= 1.0 / MAX_MESSAGES_PER_SECOND:
            self._last_sent = end[0]
            send(self.payload(final=False))

    def _close_step(self, end: tuple[float, int]) -> None:
        start, start_bytes = self._step_start
        self.steps.append(StepSample(end[1] - start_bytes, end[0] - start))
        self._step_start = end

    def finish(self) -> dict[str, Any]:
        if self._last_call is not None:
            # The last step ends with the last model call; a copy issued after it still counts.
            self._close_step((self._last_call[0], self.handle.ledger.bytes_h2d))
            self._last_call = None
        payload = self.payload(final=True)
        send(payload)
        return payload

    def payload(self, final: bool) -> dict[str, Any]:
        return telemetry_payload(self.handle.stats(), self.steps, self.node_id, self.cpu_only, final)


def telemetry_payload(stats: dict[str, Any], steps: list[StepSample], node_id: str | None,
                      cpu_only: bool, final: bool) -> dict[str, Any]:
    """The message the front end draws: the engine's figures plus the per-step streamed GB/s."""
    seconds = sum(s.seconds for s in steps)
    streamed = sum(s.bytes_h2d for s in steps)
    return {
        "node_id": node_id,
        "final": final,
        "cpu_only": cpu_only,
        "groups": stats["groups"],
        "resident_groups": stats["resident_groups"],
        "streamed_groups": stats["groups"] - stats["resident_groups"],
        "resident_bytes": stats["resident_bytes"],
        "streamed_bytes_per_pass": stats["streamed_bytes_per_pass"],
        "bytes_h2d": stats["bytes_h2d"],
        "bytes_d2h": stats["bytes_d2h"],
        "copies_h2d": stats["copies_h2d"],
        "onloads": stats["onloads"],
        "sync_onloads": stats["sync_onloads"],
        "compute_wait_ms": stats["compute_wait_ms"],
        "hook_us_per_group": stats["hook_us_per_group"],
        "steps": len(steps),
        "bytes_per_step": streamed / len(steps) if steps else 0.0,
        "h2d_gbps": streamed / seconds / 1e9 if seconds > 0 else 0.0,
        "step_gbps": [round(s.gbps, 3) for s in steps[-MAX_STEPS_SHOWN:]],
    }


def send(payload: dict[str, Any]) -> None:
    """Push ``payload`` to the client that queued the prompt (no-op without a running server)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    instance = getattr(PromptServer, "instance", None)
    if instance is not None:
        instance.send_sync(EVENT, payload, instance.client_id)


_RUNS: "weakref.WeakKeyDictionary[nn.Module, tuple[RunTelemetry, Any]]" = weakref.WeakKeyDictionary()
_LAST_RUN: "weakref.WeakKeyDictionary[nn.Module, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _first_timestep(args: tuple, kwargs: dict) -> float | None:
    t = kwargs.get("timesteps", kwargs.get("timestep", args[1] if len(args) > 1 else None))
    return float(t.flatten()[0]) if isinstance(t, torch.Tensor) and t.numel() else None


def start_run(diffusion_model: nn.Module, handle: GroupOffloadHandle, node_id: str | None, cpu_only: bool) -> None:
    finish_run(diffusion_model)
    handle.reset_stats()
    run = RunTelemetry(handle, node_id, cpu_only)
    hook = diffusion_model.register_forward_hook(
        lambda module, args, kwargs, output: run.on_forward(_first_timestep(args, kwargs)), with_kwargs=True)
    _RUNS[diffusion_model] = (run, hook)


def finish_run(diffusion_model: nn.Module) -> None:
    entry = _RUNS.pop(diffusion_model, None)
    if entry is not None:
        run, hook = entry
        hook.remove()
        _LAST_RUN[diffusion_model] = run.finish()


def last_run(diffusion_model: nn.Module) -> dict[str, Any] | None:
    """The final figures of the last sampling run of this model, if any."""
    return _LAST_RUN.get(diffusion_model)
