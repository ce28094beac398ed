"""What the pack keeps about one ComfyUI model: a ``ModelState``, found by ``state_of(model)``.

One registry, keyed by the model ComfyUI's patchers hold (``ModelPatcher.model``, a ``BaseModel``), and
weakly: a model's state goes with the model. The key is that model rather than its diffusion model for two
reasons. Every clone of a patcher holds the same one, so the state is the model's, whatever patcher asks.
And it stays the same object while a wrapper swaps its ``diffusion_model`` (or the blocks) for compiled ones
for the length of a call (TorchCompileModel), when the offloaded model must still be found. The diffusion
model lives inside it and goes with it. The block finder keeps its own cache beside this one
(``blocks.block_list_paths``), which is keyed by the diffusion model because it is given nothing else.

No field holds the model or its diffusion model: a state that did would keep its key alive.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from ..offload_core import GroupOffloadHandle


@dataclass(eq=False)
class ModelState:
    """Per model: its handle and what it was built for, its owners, its runs, and how its state dict is read."""

    # --- the handle (handles.py) ---
    #: the handle ``build_handle`` put on the blocks, until ``remove_handle``
    handle: "weakref.ref[GroupOffloadHandle] | None" = None
    #: the settings that handle was built for (``OffloadSettings.handle_layout``): other settings need a new one
    built_with: tuple | None = None
    #: the limit that bound that handle's host budget (``HostBudget.bound_by``): the readout names it
    host_limit: str | None = None
    #: the hooks on the diffusion model that guard the handle (``handles._guard``)
    guards: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    #: the ``OutsideUseWatch`` of a call that learns the handle's entries, on the torch function mode stack of
    #: the thread running that call until the call ends (``handles.stop_watching``)
    watch: Any = None
    #: how many GroupOffloadPatchers (the node's clone and every clone of it) can drive the handle
    owners: int = 0
    #: those patchers, alive: a patcher of this model not among them is a plain one
    offload_patchers: "weakref.WeakSet[ModelPatcher]" = field(default_factory=weakref.WeakSet)
    #: when the handle last started a sampling run (a counter): the least recent gives its pins up first
    run_started: int = 0

    # --- the sampling run (memory.py, telemetry.py) ---
    #: ComfyUI's estimate of the device memory the forwards of the last sampling run hold (None: no run yet)
    run_activations: int | None = None
    #: the run in progress: its telemetry (a ``telemetry.RunTelemetry``, which reads this module), from ``pre_run``
    #: to ``cleanup``
    run: Any = None
    #: the final figures of the last run
    last_run: dict[str, Any] | None = None

    # --- the model's own state dict (patcher.py) ---
    #: the reader of the state dict now (a reference to the reading patcher, or one to nobody when only the keys
    #: are read); None when nobody reads it
    reading: "Callable[[], ModelPatcher | None] | None" = None
    #: the patcher whose ``load(force_patch_weights=True)`` patched the model, for the next read
    read_after_load: "weakref.ref[ModelPatcher] | None" = None
    #: whether the state-dict hook is on the diffusion model
    state_dict_hooked: bool = False

    # --- a text encoder (text_encoder.py) ---
    #: whether the hooks that make each encode a run for the telemetry are on the owning encoder
    encodes_hooked: bool = False

    # --- Dynamic VRAM (patcher.py) ---
    #: for a Dynamic VRAM model, its non-dynamic twin, as ``clone(model_override=...)`` takes it
    non_dynamic_twin: tuple | None = None


_STATES: "weakref.WeakKeyDictionary[nn.Module, ModelState]" = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> ModelState:
    """The state of ``model`` (a patcher's ``model``), made empty at the first call."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = ModelState()
    return state


def every_state() -> list[tuple[nn.Module, ModelState]]:
    """Each model with a state, alive, and its state."""
    return list(_STATES.items())
