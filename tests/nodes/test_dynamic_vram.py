"""Newest ComfyUI's Dynamic VRAM, driven as far as the CPU allows: its global switch, its patcher, its loaders.

main.py, when comfy-aimdo starts, sets ``comfy.memory_management.aimdo_enabled`` (Linear weights then
load lazily, in the file's dtype) and installs ``ModelPatcherDynamic`` as ``CoreModelPatcher`` (the
class every loader returns). Both are set here the same way (the switch: the ``aimdo_switch`` fixture, in
conftest.py); ComfyUI's code runs unchanged.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from testbed.comfy_boot import TESTBED_DIR, comfyui_path
from testbed.run_nodes import run_txt2img
from testbed.node_runs import FOUR_BLOCKS, offload_handle, load_offloaded, load_plain, offload


def file_state_dict() -> dict[str, torch.Tensor]:
    import folder_paths
    from safetensors.torch import load_file

    return load_file(folder_paths.get_full_path_or_raise("diffusion_models", FOUR_BLOCKS))


def file_block_bytes() -> int:
    """The bf16 bytes of the fixture's blocks, as the file holds them."""
    return sum(t.nbytes for key, t in file_state_dict().items() if key.startswith("transformer_blocks."))


def mirror_dtypes(model) -> set[torch.dtype]:
    return {s.dtype for g in offload_handle(model).groups for s in g.mirror.segments}


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_fp8_is_honoured_with_the_switch_on(models, aimdo_switch, weight_dtype):
    fp8 = load_offloaded(weight_dtype)
    assert offload_handle(fp8).stats()["host_bytes"] < 0.6 * file_block_bytes()
    assert {torch.float8_e4m3fn, torch.float8_e5m2} & mirror_dtypes(fp8)


def test_fp8_through_the_node_with_the_switch_on(models, aimdo_switch):
    import comfy.sd

    # UNETLoader's own load, minus its file reader (comfy-aimdo's mmap needs a GPU)
    plain = comfy.sd.load_diffusion_model_state_dict(file_state_dict(), model_options={"dtype": torch.float8_e4m3fn})
    offloaded = offload(plain)
    offloaded.load(torch.device("cpu"), lowvram_model_memory=1 << 40, full_load=True)
    assert offload_handle(offloaded).stats()["host_bytes"] < 0.6 * file_block_bytes()
    offloaded.detach()


@pytest.fixture(scope="module")
def dynamic_run(comfy, tmp_path_factory) -> dict:
    """What testbed/dynamic_vram_driver.py saw, run in a ComfyUI started as main.py starts it with Dynamic VRAM."""
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no Dynamic VRAM")
    pytest.importorskip("comfy_aimdo")
    done = subprocess.run([sys.executable, str(TESTBED_DIR / "dynamic_vram_driver.py"),
                           str(tmp_path_factory.mktemp("dynamic_vram"))],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, COMFYUI_PATH=str(comfyui_path())))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_the_node_keeps_one_host_copy_however_often_it_runs(dynamic_run):
    assert dynamic_run["dynamic"] and not any(dynamic_run["offloaded_dynamic"])
    assert dynamic_run["distinct_offloaded_models"] == 1, "four runs (two with a LoRA) share one plain model"
    (models_before, bytes_before), (models_after, bytes_after) = dynamic_run["models_before"], dynamic_run["models_after"]
    assert models_after == models_before + 1
    assert bytes_after - bytes_before <= 2 * bytes_before  # one more copy (up to float32 where the file is bf16)
    assert dynamic_run["lora_patches"][0] == 0 < dynamic_run["lora_patches"][2] == dynamic_run["lora_patches"][3]


def test_a_quantized_dynamic_model_streams_its_quantized_weights(models, dynamic_run):
    quantized = dynamic_run["quantized"]
    assert quantized["dynamic"] and not quantized["offloaded_dynamic"]
    assert quantized["weight_types"] == ["QuantizedTensor"]
    assert quantized["host_bytes"] < 0.6 * file_block_bytes(), "fp8 data and scales, not bf16 or float32"


def test_deep_clones_of_the_nodes_output_load_again(dynamic_run):
    assert dynamic_run["deep_clone"] == ["GroupOffloadPatcher", True, True]


def test_a_dynamic_model_that_cannot_be_loaded_again_gets_a_clear_message(dynamic_run):
    assert "Group Offload needs this model without Dynamic VRAM" in dynamic_run["without_factory"]


def test_deep_clones_of_the_loaders_output_load_again(models):
    from comfy.model_patcher import ModelPatcher

    if "force_deepcopy" not in inspect.signature(ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no deep clones")
    loaded = load_offloaded()
    expected = run_txt2img(loaded, seed=14).latent
    deep = loaded.clone(force_deepcopy=True)
    assert type(deep) is type(loaded) and deep.model is not loaded.model
    assert torch.equal(run_txt2img(deep, seed=14).latent, expected)


def test_a_deep_clone_without_a_loader_to_load_again_is_refused(models):
    from comfy.model_patcher import ModelPatcher

    if "force_deepcopy" not in inspect.signature(ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no deep clones")
    plain = load_plain()
    plain.cached_patcher_init = None  # as a custom loader leaves it
    with pytest.raises(ValueError, match="cannot be deep-copied"):
        offload(plain).clone(force_deepcopy=True)
