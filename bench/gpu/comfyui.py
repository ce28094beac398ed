"""ComfyUI in this process, started as its main.py starts it, and the model through its own loader."""
from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from .config import GIB, BenchConfig
from .weights import random_state_dict


def start_comfyui(config: BenchConfig, dynamic: bool, flags: dict[str, bool] | None = None) -> str:
    """Import ComfyUI into this process as main.py starts it; returns which patcher it runs.

    ``dynamic``: comfy-aimdo's library first, then its devices, ``ModelPatcherDynamic`` as the core
    patcher and the global switch, as main.py does by default. Without CUDA (``--smoke``) ComfyUI
    runs ``--cpu``, which switches Dynamic VRAM off in main.py too. ``flags``: command-line flags
    (``comfy.cli_args.args`` names, e.g. ``lowvram``), set before ComfyUI reads them at import.
    """
    from testbed.comfy_boot import boot_comfyui_in_process, prepare_comfy_import
    from testbed.fixture_models import widen_qwen_detection

    prepare_comfy_import(cpu=config.smoke)
    import comfy.cli_args

    for name, value in (flags or {}).items():
        setattr(comfy.cli_args.args, name, value)
    if dynamic and not config.smoke:
        import comfy_aimdo.control

        _call_first_accepted(comfy_aimdo.control.init, dict(simple_vram_headroom=None, nvml_pressure=True),
                             dict(simple_vram_headroom=None), {})
    boot_comfyui_in_process(cpu=config.smoke)
    if config.smoke:
        widen_qwen_detection()  # the tiny model's widths (full-size Qwen-Image is detected as it is)
    if not dynamic or config.smoke:
        return "legacy ModelPatcher"
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control
    from comfy.cli_args import args

    devices = mm.get_all_torch_devices()
    try:
        started = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * GIB)) for d in devices)
    except TypeError:
        started = comfy_aimdo.control.init_devices(d.index for d in devices)
    if not started:
        return "legacy ModelPatcher (comfy-aimdo did not start)"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return "Dynamic VRAM (ModelPatcherDynamic)"


def comfy_system(patcher: str) -> str:
    """The name of ComfyUI's own rows for the patcher :func:`start_comfyui` started."""
    return "ComfyUI (Dynamic VRAM)" if "Dynamic" in patcher else "ComfyUI legacy"


def _call_first_accepted(function: Callable[..., Any], *keyword_sets: dict[str, Any]) -> Any:
    """``function(**kwargs)`` with the first keyword set this version accepts (older protocols take fewer)."""
    for kwargs in keyword_sets[:-1]:
        try:
            return function(**kwargs)
        except TypeError:
            continue
    return function(**keyword_sets[-1])


def comfy_allocator_env() -> dict[str, str]:
    """``PYTORCH_CUDA_ALLOC_CONF`` as ComfyUI's main.py sets it (its ``cuda_malloc`` module decides)."""
    from testbed.comfy_boot import comfyui_path

    probe = ("import os, sys; sys.path.insert(0, sys.argv[1]); import cuda_malloc; "
             "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))")
    done = subprocess.run([sys.executable, "-c", probe, str(comfyui_path())], capture_output=True, text=True,
                          cwd=comfyui_path())
    value = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return {"PYTORCH_CUDA_ALLOC_CONF": value} if value else {}


def load_comfy_model(config: BenchConfig, dtype: torch.dtype, dynamic_patcher: bool) -> Any:
    """A MODEL from ComfyUI's own loader, with a loader ComfyUI can call again (as for a file)."""
    import comfy.sd

    accepts = "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters

    def load(disable_dynamic: bool = False) -> Any:
        owned = not disable_dynamic and dynamic_patcher  # Dynamic VRAM keeps the tensors it is given
        state_dict = random_state_dict(config, dtype, owned=owned)
        extra = {"disable_dynamic": disable_dynamic} if accepts else {}
        return comfy.sd.load_diffusion_model_state_dict(state_dict, model_options={}, **extra)

    model = load(disable_dynamic=not dynamic_patcher)
    model.cached_patcher_init = (load, ())
    return model
