"""Samples plain and offloaded models in a ComfyUI started the way main.py starts it, and prints what it saw as JSON.

Run by tests/nodes/test_cuda_nodes.py in its own process (``cuda_nodes_driver.py MODELS_BASE_DIR``), because
Dynamic VRAM must be switched on as main.py does it, before ComfyUI imports its modules: comfy-aimdo's
library loaded first, then its devices initialised and ``ModelPatcherDynamic`` installed as the class
every loader returns. On a GPU that is what runs; under ``--cpu`` main.py leaves Dynamic VRAM off, and so
does this, so the same flow runs on the legacy ModelPatcher (pinning then goes through the CUDA-runtime
stand-in, as the in-process tests pin on the CPU).

:func:`offload_lifecycle` is also what the in-process tests measure with: one model sampled twice, unloaded,
then dropped, and what each stage left behind, as plain JSON values.
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run by path: the repository root, for testbed

from testbed.comfy_boot import boot_comfyui_in_process, prepare_comfy_import  # noqa: E402
from testbed.fixture_models import ModelDir, use_models_in_process
from testbed.run_nodes import run_txt2img  # noqa: E402
from testbed.node_runs import offload_handle, load_offloaded, load_plain, offload, with_lora  # noqa: E402

SEED = 31
STEPS = 2
LORA_STRENGTH = 0.8
# variant -> (its reference: the model without offloading, how the offloaded model is made)
VARIANTS: dict[str, tuple[str, Callable[[], Any]]] = {
    "node": ("plain", lambda: offload(load_plain())),
    "loader": ("plain", load_offloaded),
    "lora_then_node": ("lora", lambda: offload(with_lora(load_plain(), LORA_STRENGTH))),
}


def sample(model, **size: int) -> torch.Tensor:
    """The latent of KSampler, seeded as every run here (``size``: ``width``, ``height``)."""
    return run_txt2img(model, seed=SEED, steps=STEPS, **size).latent


def _held(device: torch.device) -> tuple[int, int]:
    """ComfyUI's pinned-memory total, and the device memory torch has handed out (0 off CUDA).

    Less cuBLAS's workspaces: torch keeps one for every stream a matmul ran on (the copy stream's LoRA
    matmuls too) until told to let them go.
    """
    import comfy.model_management as mm

    if device.type != "cuda":
        return mm.TOTAL_PINNED_MEMORY, 0
    torch._C._cuda_clearCublasWorkspaces()
    return mm.TOTAL_PINNED_MEMORY, torch.cuda.memory_allocated(device)


def _since(before: tuple[int, int], device: torch.device) -> dict[str, int]:
    pinned, allocated = _held(device)
    return {"comfy_pinned": pinned - before[0], "device_allocated": allocated - before[1]}


def _streaming(model, device: torch.device) -> dict[str, Any]:
    """What the last sampling run of an offloaded model streamed, and which host copies are pinned."""
    handle = offload_handle(model)
    stats = handle.stats()
    streamed = [g for g in handle.groups if not g.resident]
    return {
        "streamed_groups": len(streamed),
        "forwards": stats["hook_calls"] // stats["groups"],
        "copies_h2d": stats["copies_h2d"],
        "bytes_h2d": stats["bytes_h2d"],
        "bytes_d2h": stats["bytes_d2h"],
        "streamed_bytes_per_pass": stats["streamed_bytes_per_pass"],
        "device_bytes": handle.device_bytes_needed(),  # resident groups and slabs
        "pinned_bytes": stats["pinned_bytes"],
        "patcher_pinned_bytes": model.pinned_memory_size(),
        "streamed_pinned": [g.mirror.pinned for g in streamed],
        "resident_pinned": [g.mirror.pinned for g in handle.groups if g.resident],
        # the driver's own view: page-locked host memory (only CUDA can tell)
        "streamed_page_locked": [g.mirror.buffer.is_pinned() for g in streamed] if device.type == "cuda" else None,
    }


def offload_lifecycle(make_model: Callable[[], Any], expected: torch.Tensor, **size: int) -> dict[str, Any]:
    """Sample ``make_model()`` twice against ``expected``, unload it, drop it; what each stage left.

    The streaming figures are the second run's (the first one learns the order). Memory is counted from
    the moment before the model is made, with every other model unloaded.
    """
    import comfy.model_management as mm

    device = mm.get_torch_device()
    mm.unload_all_models()
    gc.collect()
    before = _held(device)
    model = make_model()
    identical = [torch.equal(sample(model, **size), expected) for _ in range(2)]
    facts = {
        "identical": identical,
        "patcher": type(model).__name__,
        "dynamic": getattr(model, "is_dynamic", lambda: False)(),
        **_streaming(model, device),
        "loaded": _since(before, device),
    }
    handle = weakref.ref(offload_handle(model))
    mm.unload_all_models()
    facts["unloaded"] = {**_since(before, device), "handle_kept": offload_handle(model) is handle(),
                         "onloaded_groups": sum(g.onloaded for g in handle().groups),
                         "slab_bytes": handle().stats()["slab_bytes"], "loaded_size": model.loaded_size()}
    del model
    gc.collect()
    facts["freed"] = {**_since(before, device), "handle_alive": handle() is not None}
    return facts


def start_comfyui_as_main_py_does() -> bool:
    """Boot ComfyUI in this process in main.py's order; returns whether Dynamic VRAM is on."""
    prepare_comfy_import()  # ComfyUI on sys.path, its arguments parsed (``--cpu`` without CUDA)
    import comfy_aimdo.control
    from comfy.cli_args import args, enables_dynamic_vram

    if enables_dynamic_vram():  # before ComfyUI imports its modules
        headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024**3)
        for protocol in ({"simple_vram_headroom": headroom, "nvml_pressure": not args.disable_nvml_pressure},
                         {"simple_vram_headroom": headroom}, {}):  # comfy-aimdo 0.4.11 and later, 0.4.10, 0.4.9
            with contextlib.suppress(TypeError):
                comfy_aimdo.control.init(**protocol)
                break
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    dynamic = False
    if enables_dynamic_vram() and mm.is_nvidia():  # main.py's dynamic_vram_supported(), on NVIDIA
        devices = mm.get_all_torch_devices()
        try:
            dynamic = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024**3)) for d in devices)
        except TypeError:  # comfy-aimdo 0.4.9's protocol
            dynamic = comfy_aimdo.control.init_devices(d.index for d in devices)
    if dynamic:
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    boot_comfyui_in_process()
    return bool(dynamic)


def main(models_dir: Path) -> dict[str, Any]:
    dynamic = start_comfyui_as_main_py_does()
    import comfy.model_management as mm

    device = mm.get_torch_device()
    if device.type == "cpu":
        from testbed.fake_cudart import install

        install()  # ComfyUI pins through the CUDA-runtime stand-in, as on a GPU machine
    use_models_in_process(ModelDir(models_dir))
    plain = load_plain()
    references = {"plain": sample(plain), "lora": sample(with_lora(plain, LORA_STRENGTH))}
    return {
        "device": device.type,
        "dynamic_vram": dynamic,
        "plain_dynamic": plain.is_dynamic(),
        "variants": {name: offload_lifecycle(make, references[reference]) for name, (reference, make) in VARIANTS.items()},
    }


if __name__ == "__main__":
    print("RESULTS " + json.dumps(main(Path(sys.argv[1]))))
