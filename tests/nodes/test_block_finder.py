"""The block finder on the diffusion models ComfyUI ships, built tiny on the CPU from ComfyUI's own classes.

Each model is built the way ComfyUI builds a loaded checkpoint (its ``supported_models`` config, then
``get_model``), wrapped in a real ModelPatcher and run through ``BaseModel.apply_model``: once plain,
with the order of the block calls recorded, then through the Group Offload node. Saved to a file in
its own keys, it then loads through Load Diffusion Model and through the Group Offload loader.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

from testbed.run_nodes import run_node
from testbed.other_models import save_with_detection
from testbed.pack_modules import pack_module
from testbed.quantized_files import QUANT_FORMATS, cpu_skip_reason, quantize_state_dict
from testbed.dit_families import MODELS, TinyModel, build, comfy_version, noise, save_tiny_file, supported_config

OFFLOAD = {"blocks_per_group": 2, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


def denoise(patcher, tiny: TinyModel) -> torch.Tensor:
    """One ``apply_model`` call of ``patcher``'s model, loaded by ComfyUI as a sampler would load it."""
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    with torch.inference_mode():
        return patcher.model.apply_model(noise(*tiny.latent), torch.full(tiny.latent[:1], 0.6), **tiny.conds())


def first_calls(modules: list[nn.Module], methods: tuple[str, ...],
                run: Callable[[], torch.Tensor]) -> tuple[list[nn.Module], torch.Tensor]:
    """The modules in the order of the first call of one of their ``methods`` during ``run()``, and its result."""
    called: list[nn.Module] = []

    def recording(module: nn.Module, method: Callable) -> Callable:
        def record(*args, **kwargs):
            if module not in called:
                called.append(module)
            return method(*args, **kwargs)
        return record

    for module in modules:
        for name in methods:
            setattr(module, name, recording(module, getattr(module, name)))
    try:
        return called, run()
    finally:
        for module in modules:
            for name in methods:
                delattr(module, name)


@pytest.mark.parametrize("name", MODELS)
def test_offloaded_model_is_bit_identical_and_its_blocks_run_in_order(comfy, name):
    import comfy.model_management as mm

    blocks_module = pack_module("nodes.blocks")
    tiny = MODELS[name]
    plain = build(tiny)
    diffusion_model = plain.model.diffusion_model
    blocks = blocks_module.find_blocks(diffusion_model)
    methods = tuple({"forward", *pack_module("offload_core.hooks")._public_methods(blocks[0])})
    order, expected = first_calls(blocks, methods, lambda: denoise(plain, tiny))
    assert order == blocks, "find_blocks lists every block in the order of its first call"

    offloaded = run_node("GroupOffload", model=plain, **OFFLOAD).outputs[0]
    try:
        assert torch.equal(denoise(offloaded, tiny), expected)
        stats = pack_module("offload_core").handle_of(blocks[0]).stats()
        assert stats["groups"] == (len(blocks) + 1) // 2
        assert stats["sync_onloads"] == stats["groups"], "every group ran through the handle"
        assert stats["copies_h2d"] == stats["groups"] + 1, "and the last one prefetched the first for the next pass"
        assert stats["bytes_d2h"] == 0
    finally:
        mm.unload_all_models()
    assert blocks_module.find_blocks(diffusion_model) == blocks, "the same blocks, in the same order, every call"


# Models whose ComfyUI constructor reads a value of a tensor it makes, which the loader's build on the meta
# device cannot give: the loader refuses them, naming the cause and the way round (the node).
NOT_ON_META = {"ace_step15": r"Tensor\.item\(\) cannot be called on meta tensors"}  # FSQ sizes its codebook


@pytest.mark.parametrize("name", MODELS)
def test_the_loader_reads_a_file_in_comfyuis_keys_bit_identically(comfy_models, name):
    import comfy.model_management as mm

    tiny = MODELS[name]
    supported_config(tiny.config)  # (skips first where this ComfyUI has no such model)
    if tiny.outside():
        pytest.skip(f"Load Diffusion Model cannot load {tiny.config} from a file of its diffusion model alone")
    unet_name = save_tiny_file(tiny, comfy_models.models_dir / "diffusion_models" / f"block_finder_{name}.safetensors")
    plain = run_node("UNETLoader", unet_name=unet_name, weight_dtype="default").outputs[0]
    expected = denoise(plain, tiny)
    if name in NOT_ON_META:
        with pytest.raises(ValueError, match=rf"could not build its model on the meta device.*{NOT_ON_META[name]}.*"
                                             r"use Load Diffusion Model followed by Group Offload"):
            run_node("GroupOffloadLoader", unet_name=unet_name, weight_dtype="default", **OFFLOAD)
        return
    loaded = run_node("GroupOffloadLoader", unet_name=unet_name, weight_dtype="default", **OFFLOAD).outputs[0]
    try:
        assert torch.equal(denoise(loaded, tiny), expected)
        blocks = pack_module("nodes.blocks").find_blocks(loaded.model.diffusion_model)
        stats = pack_module("offload_core").handle_of(blocks[0]).stats()
        assert stats["groups"] == (len(blocks) + 1) // 2 and stats["bytes_d2h"] == 0
    finally:
        mm.unload_all_models()


def released_keys(tiny: TinyModel, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` under the names its released checkpoints use where ComfyUI renames at load: each norm
    weight (1-D ``.weight``) that ComfyUI's ``process_unet_state_dict`` makes of a ``.scale`` (Flux's
    RMSNorms) is named ``.scale``."""
    config = supported_config(tiny.config)(tiny.full_config())
    released = {}
    for key, tensor in state_dict.items():
        scale = key.removesuffix(".weight") + ".scale"
        renamed = (key.endswith(".weight") and tensor.dim() == 1
                   and list(config.process_unet_state_dict({scale: tensor})) == [key])
        released[scale if renamed else key] = tensor
    return released


@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"], ids=["bf16", "fp8mixed"])
@pytest.mark.parametrize("name", ["flux", "flux2", "chroma"])
def test_the_loader_reads_a_flux_family_file_as_released_bit_identically(comfy_models, name, fmt):
    """Keys as Black Forest Labs' files name them (RMSNorm weights ``.scale``) and, as in Flux 2's official
    fp8mixed file, the blocks' Linears quantized in ``comfy_quant`` tensors: read straight into the host
    copies, they give Load Diffusion Model's result, and the quantized weights stream as they are."""
    import comfy.model_management as mm

    if fmt is not None and (reason := cpu_skip_reason(fmt)):
        pytest.skip(reason)
    tiny = MODELS[name]
    diffusion_model = build(tiny).model.diffusion_model
    state_dict = released_keys(tiny, diffusion_model.state_dict())
    if not any(key.endswith(".scale") for key in state_dict):
        pytest.skip(f"ComfyUI {comfy_version()} renames no {tiny.config} keys at load")
    blocks = tuple(f"{path}." for path in pack_module("nodes.blocks").block_list_paths(diffusion_model))
    if fmt is not None:
        state_dict, _ = quantize_state_dict(state_dict, QUANT_FORMATS[fmt], blocks)
    path = comfy_models.models_dir / "diffusion_models" / f"released_{name}_{fmt or 'bf16'}.safetensors"
    save_with_detection(state_dict, tiny.config, tiny.saved_config(), path)
    with torch.inference_mode():
        plain = run_node("UNETLoader", unet_name=path.name, weight_dtype="default").outputs[0]
        loaded = run_node("GroupOffloadLoader", unet_name=path.name, weight_dtype="default", **OFFLOAD).outputs[0]
    try:
        expected = denoise(plain, tiny)
        assert torch.equal(denoise(loaded, tiny), expected)
        weights = {type(p).__name__ for p in loaded.model.diffusion_model.parameters()}
        assert ("QuantizedTensor" in weights) == (fmt is not None)
        handle = pack_module("offload_core").handle_of(pack_module("nodes.blocks").find_blocks(loaded.model.diffusion_model)[0])
        assert handle.stats()["bytes_d2h"] == 0
    finally:
        mm.unload_all_models()


class TwoListDiT(nn.Module):
    """Embedders around a double and a single block list, as in Flux."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.double_blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.single_blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


class WrappedDiT(nn.Module):
    """The trunk inside a wrapper (as HiDream-O1's language_model), beside an embedder with blocks of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.text_refiner = nn.Sequential(nn.Linear(8, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(2)))
        self.transformer = TwoListDiT()


def test_nested_lists_are_found_and_stay_found_while_hidden_for_comfyuis_load(comfy):
    blocks_module, patcher = pack_module("nodes.blocks"), pack_module("nodes.patcher")
    model = WrappedDiT()
    paths = blocks_module.block_list_paths(model)
    assert paths == ("transformer.double_blocks", "transformer.single_blocks")
    lists = [model.get_submodule(path) for path in paths]
    with patcher._blocks_hidden(model):
        assert all(len(model.get_submodule(path)) == 0 for path in paths)
        assert blocks_module.block_list_paths(model) == paths and blocks_module.find_blocks(model) == []
    assert [model.get_submodule(path) for path in paths] == lists


# Block lists at the real sizes (models built on the meta device from each config's defaults). The
# small lists beside the trunk (refiners, injectors, embedders) stay out.
REAL_SIZE = {
    "SD3": ("joint_blocks",),
    "AuraFlow": ("double_layers", "single_layers"),
    "HunyuanDiT": ("blocks",),
    "LTXV": ("transformer_blocks",),
    "Lumina2": ("layers",),
    "WAN21_T2V": ("blocks",),
    "WAN22_S2V": ("blocks",),
    "WAN22_Animate": ("blocks",),
    "Hunyuan3Dv2": ("double_blocks", "single_blocks"),
    "Hunyuan3Dv2_1": ("blocks",),
    "ACEStep": ("transformer_blocks",),
    "Omnigen2": ("layers",),
    "QwenImage": ("transformer_blocks",),
    "LTXAV": ("transformer_blocks",),
    "Kandinsky5": ("visual_transformer_blocks",),
    "Boogu": ("double_stream_layers", "single_stream_layers"),
    "HiDreamO1": ("language_model.layers",),
    "MiniMaxMusic3": ("diffusion_transformer.transformer.layers",),
    "WAN22_WanDancer": ("blocks",),
    "PixelDiTT2I": ("patch_blocks",),
    "ErnieImage": ("layers",),
    "Lens": ("transformer_blocks",),
    "Ideogram4": ("layers",),
    "CogVideoX_T2V": ("blocks",),
    "Krea2": ("blocks",),
    "Anima": ("blocks",),
}
# Sizes that a config's defaults lack and ComfyUI reads from the checkpoint (Anima's released file: a
# 2048-wide Cosmos Predict 2 trunk of 28 blocks, beside a 6-layer text adapter that a tiny trunk would outweigh).
REAL_SIZE_CONFIGS = {
    "Anima": {**MODELS["cosmos_predict2"].unet_config, "image_model": "anima", "in_channels": 16,
              "out_channels": 16, "model_channels": 2048, "num_blocks": 28, "num_heads": 16, "crossattn_emb_channels": 1024,
              "adaln_lora_dim": 256, "max_img_h": 240, "max_img_w": 240, "max_frames": 128},
}


def meta_model(config: str) -> nn.Module:
    config_class = supported_config(config)
    with torch.device("meta"):
        return config_class(REAL_SIZE_CONFIGS.get(config, dict(config_class.unet_config))).get_model({}).diffusion_model


@pytest.mark.parametrize("config, paths", REAL_SIZE.items(), ids=list(REAL_SIZE))
def test_real_size_block_lists(comfy, config, paths):
    assert pack_module("nodes.blocks").block_list_paths(meta_model(config)) == paths


def test_a_unet_is_refused_with_a_clear_message(comfy):
    import comfy.model_management as mm
    import comfy.supported_models
    from comfy.model_patcher import ModelPatcher

    unet_config = {"image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32, "num_res_blocks": [1, 1],
                   "channel_mult": [1, 2], "transformer_depth": [1, 1], "transformer_depth_middle": 1,
                   "transformer_depth_output": [1, 1, 1, 1], "context_dim": 32, "num_heads": 2, "num_head_channels": -1,
                   "use_checkpoint": False, "use_spatial_transformer": True, "legacy": False, "adm_in_channels": None,
                   "use_linear_in_transformer": False, "use_temporal_attention": False, "use_temporal_resblock": False}
    with torch.device("meta"):
        model = comfy.supported_models.SD15(unet_config).get_model({})
    patcher = ModelPatcher(model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
    with pytest.raises(ValueError, match="UNetModel has no list of transformer blocks that Group Offload can stream"):
        run_node("GroupOffload", model=patcher, **OFFLOAD)


CASCADE_STAGES = {  # each level a list of ResBlock, TimestepBlock and AttnBlock in turn, in a list of levels
    "c": {"c_cond": 32, "c_hidden": [32, 32], "nhead": [2, 2], "blocks": [[2, 2], [2, 2]], "c_clip_text": 32,
          "c_clip_text_pooled": 32, "c_clip_img": 32},
    "b": {"c_cond": 32, "c_hidden": [32, 32, 32, 32], "nhead": [-1, -1, 2, 2], "blocks": [[1, 1, 1, 1], [1, 1, 1, 1]],
          "block_repeat": [[1, 1, 1, 1], [1, 1, 1, 1]], "c_clip": 32},
}


def stable_cascade(stage: str) -> nn.Module:
    config_class = supported_config(f"Stable_Cascade_{stage.upper()}")
    config = {"stable_cascade_stage": stage, **CASCADE_STAGES[stage]}
    return config_class(config).get_model({}).diffusion_model  # (meta is slower here)


@pytest.mark.parametrize("make", [lambda: stable_cascade("c"), lambda: stable_cascade("b"), lambda: nn.Linear(2, 2)],
                         ids=["stable_cascade_c", "stable_cascade_b", "linear"])
def test_a_model_without_repeated_blocks_is_named(comfy, make):
    model = make()
    with pytest.raises(ValueError, match=f"where {type(model).__name__} keeps its blocks: no list of repeated modules"):
        pack_module("nodes.blocks").find_blocks(model)


def test_a_same_named_class_without_the_listed_blocks_gets_the_generic_rule(comfy):
    class NextDiT(nn.Module):  # not Lumina 2's: no ``layers``
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    model = NextDiT()
    assert pack_module("nodes.blocks").find_blocks(model) == list(model.blocks)


def test_the_rule_used_is_logged_once_per_class(comfy, caplog):
    blocks_module = pack_module("nodes.blocks")
    caplog.set_level(logging.INFO, logger=blocks_module.__name__)
    for _ in range(2):
        model = TwoListDiT()
        assert blocks_module.find_blocks(model) == [*model.double_blocks, *model.single_blocks]
    messages = [r.getMessage() for r in caplog.records if r.name == blocks_module.__name__]
    assert messages == ["Group Offload: the blocks of TwoListDiT are double_blocks, single_blocks (by the generic rule)"]
