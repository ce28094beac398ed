"""Newest ComfyUI's Dynamic VRAM, driven as far as the CPU allows: its global switch, its patcher, its loaders.

main.py, when comfy-aimdo starts, sets ``comfy.memory_management.aimdo_enabled`` (Linear weights then
load lazily, in the file's dtype) and installs ``ModelPatcherDynamic`` as ``CoreModelPatcher`` (the
class every loader returns). Both are set here the same way; ComfyUI's code runs unchanged.
"""
from __future__ import annotations

import pytest
import torch

from test_nodes import FOUR_BLOCKS, engine, load_offloaded, models, offload  # noqa: F401  (models: fixture)


@pytest.fixture
def aimdo_switch(comfy, monkeypatch):
    """Dynamic VRAM's global switch on, as main.py sets it when comfy-aimdo starts."""
    memory_management = pytest.importorskip("comfy.memory_management", reason="this ComfyUI has no Dynamic VRAM")
    monkeypatch.setattr(memory_management, "aimdo_enabled", True)


def mirror_dtypes(model) -> set[torch.dtype]:
    return {s.dtype for g in engine(model).groups for s in g.mirror.segments}


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_fp8_is_honoured_with_the_switch_on(models, aimdo_switch, weight_dtype):
    fp8, bf16 = load_offloaded(weight_dtype), load_offloaded()
    fp8_bytes, bf16_bytes = engine(fp8).stats()["host_bytes"], engine(bf16).stats()["host_bytes"]
    assert fp8_bytes < 0.6 * bf16_bytes
    assert {torch.float8_e4m3fn, torch.float8_e5m2} & mirror_dtypes(fp8)


def offloaded_from_state_dict(options: dict):
    """UNETLoader's own load, minus its file reader (comfy-aimdo's mmap needs a GPU), then the node."""
    import comfy.sd
    import folder_paths
    from safetensors.torch import load_file

    state_dict = load_file(folder_paths.get_full_path_or_raise("diffusion_models", FOUR_BLOCKS))
    offloaded = offload(comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=options))
    offloaded.load(torch.device("cpu"), lowvram_model_memory=1 << 40, full_load=True)
    return offloaded


def test_fp8_through_the_node_with_the_switch_on(models, aimdo_switch):
    fp8, bf16 = offloaded_from_state_dict({"dtype": torch.float8_e4m3fn}), offloaded_from_state_dict({})
    assert engine(fp8).stats()["host_bytes"] < 0.6 * engine(bf16).stats()["host_bytes"]
    fp8.detach(), bf16.detach()
