"""Group Offload for a CLIP: its text encoder's transformer layers stream as a diffusion model's blocks do.

A ComfyUI ``CLIP`` holds its text encoders in one module (``cond_stage_model``: one encoder, or several side by
side, as CLIP-L, CLIP-G and T5 for SD3); its patcher's model is that module. The encoder whose layers hold most of
the weights owns the blocks (``blocks.own_text_encoder_layers``); the others load as ComfyUI loads them. The
patcher is the diffusion model's ``GroupOffloadPatcher``, with the same engine and settings; what differs is
only when it runs: ComfyUI loads a CLIP's patcher before each encode (``CLIP.load_model``), and no sampler calls
its ``pre_run`` / ``cleanup``, so each call of the owning encoder is one run for the telemetry, which that call
ends, interrupted or not (``_end_interrupted_encodes``).
"""
from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn

import comfy.model_management as mm
import comfy.sd

from ..offload_core import format_bytes
from .blocks import blocks_owner, encoders_left_whole, own_text_encoder_layers, owner_path
from .handles import driving_patcher, host_limit, stop_watching
from .model_state import ModelState, state_of
from .patcher import make_offloaded
from .settings import OffloadSettings
from .telemetry import finish_run, start_run, step_done

log = logging.getLogger(__name__)


def make_offloaded_clip(clip: comfy.sd.CLIP, settings: OffloadSettings) -> comfy.sd.CLIP:
    """A clone of ``clip`` whose text encoder's layers stream; the input stays as it was."""
    text_encoders = clip.patcher.model
    own_text_encoder_layers(text_encoders)  # (a clear error for a CLIP it cannot stream, before any clone)
    clone = clip.clone()
    clone.patcher = make_offloaded(clip.patcher, settings)
    clone.cond_stage_model = clone.patcher.model  # (another model where Dynamic VRAM made a plain twin)
    _encode_on_the_gpu(clone.patcher)
    _hook_encodes(clone.patcher.model)
    left = ", ".join(f"{name} ({format_bytes(nbytes)})" for name, nbytes in encoders_left_whole(clone.patcher.model))
    log.info("Group Offload (text encoder): the layers of %s stream%s", owner_path(clone.patcher.model),
             f"; {left} load as ComfyUI loads them" if left else "")
    return clone


def _encode_on_the_gpu(patcher) -> None:
    """Under ``--lowvram`` / ``--novram`` ComfyUI encodes on the CPU (``text_encoder_device``) so that the text
    encoder never takes GPU memory whole; streamed, it takes only its groups', so it encodes on the GPU, where the
    GPU can cast the encoder's dtypes (where it cannot, ComfyUI falls back to the CPU too)."""
    device = mm.get_torch_device()
    dtypes = getattr(patcher.model, "dtypes", ())
    if torch.device(patcher.load_device).type == "cpu" and torch.device(device).type != "cpu" \
            and mm.vram_state in (mm.VRAMState.LOW_VRAM, mm.VRAMState.NO_VRAM) \
            and all(mm.supports_cast(device, dtype) for dtype in dtypes):
        log.info("Group Offload (text encoder): encoding on %s, streaming the layers (ComfyUI's low-VRAM mode would "
                 "encode on the CPU)", device)
        patcher.load_device = device


def _hook_encodes(text_encoders: nn.Module) -> None:
    """Each call of the owning encoder by one of the model's Group Offload patchers is a run for the telemetry
    (the readout of the node whose settings it has). Hooked once per model; the hooks hold neither the model nor
    its handle."""
    state = state_of(text_encoders)
    if state.encodes_hooked:
        return
    state.encodes_hooked = True
    model_ref = weakref.ref(text_encoders)

    def encode_starts(module: nn.Module, args) -> None:
        model, handle = model_ref(), state.handle() if state.handle is not None else None
        patcher = driving_patcher(model)
        if handle is None or patcher not in state.offload_patchers:
            return
        start_run(model, handle, patcher.offload_settings.node_id,
                  cpu_only=torch.device(patcher.load_device).type == "cpu", host_limit=host_limit(model),
                  left_whole=encoders_left_whole(model))

    @torch.compiler.disable
    def encode_ends(module: nn.Module, args, output) -> None:
        model = model_ref()
        if model is not None and state.run is not None:
            step_done(model)
            finish_run(model)

    owner = blocks_owner(text_encoders)
    owner.register_forward_pre_hook(encode_starts)
    owner.register_forward_hook(encode_ends, always_call=True)
    _end_interrupted_encodes(owner, state, model_ref)


def _end_interrupted_encodes(owner: nn.Module, state: ModelState, model_ref: "weakref.ref[nn.Module]") -> None:
    """End an encode that ComfyUI interrupts as the forward hooks end the others.

    torch runs forward hooks after an exception only for an ``Exception``; ComfyUI 0.33's
    ``InterruptProcessingException`` is a ``BaseException``, raised by the next op once the user interrupts. A
    diffusion model's sampler then ends the run in its ``cleanup``; a text encoder has none, so the owner's forward
    does it: the watch of the call that learns the entries off the torch function mode stack (or every later torch
    call on this thread goes through it), the groups' runs closed, the telemetry's run finished. The wrapper holds
    the owner weakly (its own ``forward`` attribute would make a reference cycle otherwise).
    """
    forward, owner_ref = type(owner).forward, weakref.ref(owner)

    @functools.wraps(forward)
    def forward_ending_interrupts(*args, **kwargs):
        try:
            return forward(owner_ref(), *args, **kwargs)
        except Exception:
            raise  # (the forward hooks end it)
        except BaseException:
            _end_encode(model_ref(), state)
            raise

    owner.forward = forward_ending_interrupts


def _end_encode(model: nn.Module | None, state: ModelState) -> None:
    """What the forward hooks and a sampler's ``cleanup`` do at the end of a call, for an interrupted encode."""
    stop_watching(state)
    handle = state.handle() if state.handle is not None else None
    if handle is not None:
        handle.close_open_groups()
    if model is not None:
        finish_run(model)
