"""The sampling run, as ComfyUI's wrappers on an offloaded model's patcher see it: no CUDA graphs, the
run's activations planned for before ComfyUI loads the model (``PREPARE_SAMPLING``), a diffusion-model
call run again with less of the model on the GPU when it runs out of memory (``APPLY_MODEL``), and the
line that says so afterwards."""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

import comfy.model_management as mm
import comfy.sampler_helpers

from ..offload_core import GroupOffloadHandle, call_backing_off, format_bytes
from .compiler import close_half_open, is_out_of_memory
from .handles import handle_for_model
from .memory import run_activations

log = logging.getLogger(__name__)

# torch.compile settings that replay CUDA graphs (ComfyUI keeps TorchCompileModel's under this key).
_CUDA_GRAPH_BACKENDS = {"cudagraphs"}
_CUDA_GRAPH_MODES = {"reduce-overhead", "max-autotune"}


def refuse_cuda_graphs(model_options: dict[str, Any]) -> None:
    """A CUDA graph replays the weight addresses it recorded, and a streamed group lands in whichever
    buffer is free: every step would record again (or read another group's weights)."""
    compiled = model_options.get("torch_compile_kwargs") or {}
    backend, mode = compiled.get("backend"), compiled.get("mode")
    setting = (f"backend {backend!r}" if backend in _CUDA_GRAPH_BACKENDS
               else f"mode {mode!r}" if mode in _CUDA_GRAPH_MODES else None)
    if setting is not None:
        raise ValueError(f"Group Offload cannot run a model compiled with CUDA graphs (TorchCompileModel's {setting}): "
                         "a graph replays the addresses of the weights it recorded, and streamed blocks move between "
                         "buffers at every step; use the inductor backend")


def plan_for_the_run(executor, patcher, noise_shape, conds, *args, **kwargs):
    """ComfyUI's ``PREPARE_SAMPLING`` wrapper: before ComfyUI loads the model, the patcher learns the
    activations of this run as ComfyUI estimates them for ``load_models_gpu`` (the same call)."""
    patcher.plan_for_run(int(comfy.sampler_helpers.estimate_memory(patcher, noise_shape, conds)[0]))
    return executor(patcher, noise_shape, conds, *args, **kwargs)


def apply_model_backing_off(executor, *args, **kwargs):
    """ComfyUI's ``APPLY_MODEL`` wrapper: the whole diffusion-model call (only this model's) runs again,
    with less of the model on the GPU, each time it runs out of GPU memory. A call that fails all the same
    (a weight its layer cannot compute with, say) gives the pinned memory back: the prompt fails with
    nothing left pinned, and the next run of the model pins it again (``pre_run``)."""
    base_model = executor.class_obj
    handle = handle_for_model(base_model)  # (``load`` built it before any forward)
    handle.check_sources()  # at every step: a file changed during the run fails it here, with a node error
    try:
        return call_backing_off(handle, lambda: executor(*args, **kwargs),
                                advice=lambda: _what_would_fit(base_model, handle),
                                out_of_memory=is_out_of_memory, before_retry=close_half_open)
    except mm.InterruptProcessingException:
        raise  # (the user stopped the run: the model is fine)
    except Exception:
        handle.unpin()
        raise


def _what_would_fit(base_model: nn.Module, handle: GroupOffloadHandle) -> str:
    """The end of the error once no fallback is left: what the model holds on the GPU then, and the room
    this run's activations would need beside it."""
    other_weights = mm.module_size(base_model) - handle.stats()["host_bytes"]
    held = handle.residency().device_bytes + other_weights
    total = mm.get_total_memory(handle.config.onload_device)
    room = total - held - mm.extra_reserved_memory()
    activations = run_activations(base_model)
    if activations > room > 0:
        fits = (f"so a latent of about {room / activations:.0%} of this one's size would fit: lower the resolution, "
                f"the frame count or the batch size")
    else:
        fits = "which would fit: other models or programs hold the rest of the GPU's memory; unload them"
    buffer = (f"; with prefetch 0 the model needs one streaming buffer "
              f"({format_bytes(max(g.nbytes for g in handle.snapshot()))}) less") if handle.prefetch else ""
    return (f"At the last plan the model held {format_bytes(held)} of the GPU's {format_bytes(total)}; ComfyUI "
            f"estimates this run's activations at {format_bytes(activations)}, {fits}{buffer}.")


def log_back_offs(run: dict[str, Any] | None) -> None:
    """One line for a sampling run that ran out of GPU memory and backed off."""
    if run is None or not run["back_offs"]:
        return
    log.warning("Group Offload: the GPU ran out of memory in this sampling run; the model call ran again with less "
                "of the model on the GPU, %d time(s), down to %d of %d groups resident with prefetch %d. The next run "
                "plans afresh; should this happen at every run, use residency budget with a smaller resident_gb",
                run["back_offs"], run["resident_groups"], run["groups"], run["prefetch"])
