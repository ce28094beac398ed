"""Runs the Group Offload node on real ``ModelPatcherDynamic`` patchers and prints what it saw, as JSON.

Run by tests/nodes/test_dynamic_vram.py in its own process, because ComfyUI must start the way main.py
starts it with Dynamic VRAM on: comfy-aimdo's library loaded before ComfyUI imports its modules, and
``ModelPatcherDynamic`` installed as the class every loader returns. Only the load device differs:
ModelPatcherDynamic hands CPU models a plain patcher, so the models here name the meta device as
their load device (nothing is loaded onto it; the node only packs host memory).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run by path: the repository root, for testbed

from testbed.comfy_boot import boot_comfyui_in_process  # noqa: E402
from testbed.fixture_models import tiny_qwen_image_file, widen_qwen_detection
from testbed.run_nodes import run_node  # noqa: E402
from testbed.fake_cudart import give_device_memory  # noqa: E402
from testbed.lora_fixture import make_lora

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
NOT_THE_CPU = {"load_device": torch.device("meta")}


def host_models() -> tuple[int, int]:
    """How many diffusion models are alive, and the bytes of their distinct parameter storages."""
    import comfy.model_base

    models = [o for o in gc.get_objects() if isinstance(o, comfy.model_base.BaseModel)]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for m in models for p in m.parameters() if p.device.type == "cpu"}
    return len(models), sum(storages.values())


def offload_quantized() -> dict:
    """An fp8 ``comfy_quant`` file under Dynamic VRAM through the node: what its blocks hold then."""
    import comfy.sd
    from testbed.quantized_files import quantized_qwen_file

    dynamic = comfy.sd.load_diffusion_model(str(quantized_qwen_file("float8_e4m3fn")), model_options=NOT_THE_CPU)
    offloaded = run_node("GroupOffload", model=dynamic, **OFFLOAD).outputs[0]
    blocks = offloaded.model.diffusion_model.transformer_blocks
    return {
        "dynamic": dynamic.is_dynamic(),
        "offloaded_dynamic": offloaded.is_dynamic(),
        "host_bytes": offloaded.handle(torch.device("cpu")).stats()["host_bytes"],  # packs the host copies
        "weight_types": sorted({type(p).__name__ for name, p in blocks.named_parameters() if name.endswith("to_q.weight")}),
    }


def main(workdir: Path) -> dict:
    import comfy_aimdo.control

    comfy_aimdo.control.init()  # main.py does this first, before ComfyUI imports comfy-aimdo's modules
    boot_comfyui_in_process()
    widen_qwen_detection()
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils

    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic  # as main.py installs it
    give_device_memory(setattr, free=24 * 2**30)  # the meta load device answers as a 24 GiB card
    path = str(tiny_qwen_image_file(num_layers=4))
    lora = comfy.utils.load_torch_file(str(make_lora(Path(path), workdir / "lora.safetensors")))

    dynamic = comfy.sd.load_diffusion_model(path, model_options=NOT_THE_CPU)
    gc.collect()
    before = host_models()
    inputs = [dynamic, dynamic] + [comfy.sd.load_lora_for_models(dynamic, None, lora, s, 0)[0] for s in (0.8, 0.3)]
    outputs = [run_node("GroupOffload", model=m, **OFFLOAD).outputs[0] for m in inputs]
    gc.collect()
    after = host_models()
    deep = outputs[0].clone(force_deepcopy=True)
    results = {
        "dynamic": dynamic.is_dynamic(),
        "offloaded_dynamic": [o.is_dynamic() for o in outputs],
        "distinct_offloaded_models": len({id(o.model) for o in outputs}),
        "models_before": before, "models_after": after,
        "lora_patches": [len(o.patches) for o in outputs],
        "deep_clone": [type(deep).__name__, deep.model is not outputs[0].model,
                       deep.offload_settings == outputs[0].offload_settings],
    }
    results["quantized"] = offload_quantized()
    no_factory = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(path), model_options=NOT_THE_CPU)
    try:
        run_node("GroupOffload", model=no_factory, **OFFLOAD)
    except ValueError as error:
        results["without_factory"] = str(error)
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(main(Path(sys.argv[1]))))
