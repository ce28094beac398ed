"""Group Offload (text encoder) and Load CLIP (Group Offload): the conditioning is ComfyUI's own, bit for bit, for
every text-encoder family the ComfyUI in use has (tiny encoders of ComfyUI's own classes, ``testbed.text_encoders``),
through clones, CLIPSetLastLayer and a CLIP LoRA on either side of the node, and after an interrupted encode; and the
offloaded CLIP's handle goes with it."""
from __future__ import annotations

import gc
import inspect
import logging

import pytest
import torch

from testbed import text_encoders
from testbed.comfy_boot import boot_comfyui_in_process
from testbed.lora_fixture import make_text_encoder_lora
from testbed.pack_modules import pack_module
from testbed.run_nodes import node_output, run_node

PROMPTS = ("a photograph of a cat", "a watercolour of a lighthouse at dusk, long shadows over the sea")
SETTINGS = {
    "stream_all": dict(blocks_per_group=1, prefetch=1, residency="stream_all", resident_gb=0.0),
    "synchronous": dict(blocks_per_group=2, prefetch=0, residency="stream_all", resident_gb=0.0),
    "auto": dict(blocks_per_group=1, prefetch=2, residency="auto", resident_gb=0.0),
}
STREAM_ALL = SETTINGS["stream_all"]
SINGLE_FILE = [name for name, family in text_encoders.TEXT_ENCODER_FAMILIES.items() if len(family.encoders) == 1]


def family_or_skip(name: str) -> text_encoders.TextEncoderFamily:
    family = text_encoders.TEXT_ENCODER_FAMILIES[name]
    if not family.available():
        pytest.skip(f"this ComfyUI has no {family.loader} type {family.type!r} for {family.encoders}")
    return family


def load(name: str, te_names: dict[str, str]):
    family = family_or_skip(name)
    return node_output(family.loader, **family.inputs(te_names))


def encodings(clip) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Both prompts, then the first again (the handle's second pass over the same layers)."""
    return [text_encoders.encode_text(clip, text) for text in (*PROMPTS, PROMPTS[0])]


def assert_identical(got: list, expected: list) -> None:
    for (cond, pooled), (cond_expected, pooled_expected) in zip(got, expected, strict=True):
        assert torch.equal(cond, cond_expected)
        assert (pooled is None) == (pooled_expected is None)
        assert pooled is None or torch.equal(pooled, pooled_expected)


def offloaded(clip, settings: dict = STREAM_ALL):
    return node_output("GroupOffloadTextEncoder", clip=clip, **settings)


def handle_of(clip):
    return pack_module("nodes.model_state").state_of(clip.patcher.model).handle()


# Every family streamed whole; one family under each other setting.
CASES = [(name, "stream_all") for name in sorted(text_encoders.TEXT_ENCODER_FAMILIES)] + [
    ("qwen_image", setting) for setting in sorted(SETTINGS) if setting != "stream_all"]


@pytest.mark.parametrize("name, setting", CASES)
def test_the_node_encodes_as_comfyui(name, setting, te_names):
    clip = load(name, te_names)
    expected = encodings(clip)
    clip_offloaded = offloaded(clip, SETTINGS[setting])
    assert_identical(encodings(clip_offloaded), expected)
    stats = handle_of(clip_offloaded).stats()
    assert stats["groups"] >= 1 and stats["bytes_d2h"] == 0
    assert_identical(encodings(clip), expected)  # the input CLIP, unchanged, after the offloaded one ran


@pytest.mark.parametrize("name", sorted(text_encoders.CHANGING_LAST_LAYER))
def test_clip_set_last_layer_before_and_after_the_node(name, te_names):
    clip = load(name, te_names)
    layer = text_encoders.CHANGING_LAST_LAYER[name]
    expected = encodings(node_output("CLIPSetLastLayer", clip=clip, stop_at_clip_layer=layer))
    before = offloaded(node_output("CLIPSetLastLayer", clip=clip, stop_at_clip_layer=layer))
    after = node_output("CLIPSetLastLayer", clip=offloaded(clip), stop_at_clip_layer=layer)
    assert_identical(encodings(before), expected)
    assert_identical(encodings(after), expected)


@pytest.mark.parametrize("name", ["qwen_image", "flux"])
def test_a_clip_lora_before_and_after_the_node(name, te_names, comfy_models):
    clip = load(name, te_names)
    lora = f"te_lora_{name}.safetensors"
    make_text_encoder_lora(clip, comfy_models.models_dir / "loras" / lora)
    model = node_output("UNETLoader", unet_name=comfy_models.unet_name, weight_dtype="default")

    def with_lora(clip_in):
        with torch.inference_mode():
            return run_node("LoraLoader", model=model, clip=clip_in, lora_name=lora, strength_model=0.0,
                            strength_clip=0.8).outputs[1]

    expected = encodings(with_lora(clip))
    assert not torch.equal(expected[0][0], encodings(clip)[0][0]), "the LoRA changed nothing"
    assert_identical(encodings(offloaded(with_lora(clip))), expected)
    assert_identical(encodings(with_lora(offloaded(clip))), expected)


IN_PLACE = dict(host_memory="budget", host_gb=0.0)


def load_in_the_files(name: str, te_names: dict[str, str], **inputs):
    family = family_or_skip(name)
    return node_output("GroupOffloadCLIPLoader", clip_name=te_names[family.encoders[0]], type=family.type,
                       **STREAM_ALL, **inputs)


def mapped(tensor: torch.Tensor) -> bool:
    return not tensor.untyped_storage().resizable()  # (frombuffer over the mapping)


def assert_layers_in_the_files(clip) -> None:
    """The layers' matrices are views of the file's read-only mapping, not copies in memory of their own (ComfyUI
    reads the norms' vectors at once); every other tensor has memory of its own, as ComfyUI loads it."""
    layers = {id(t): t for block in clip.patcher.blocks() for t in (*block.parameters(), *block.buffers())}
    matrices = [t for t in layers.values() if t.dim() >= 2]
    assert all(mapped(t) for t in matrices)
    stats = handle_of(clip).stats()
    assert stats["packed_bytes"] == 0 and stats["file_backed_bytes"] >= sum(t.nbytes for t in matrices)
    model = clip.patcher.model
    assert not [t for t in (*model.parameters(), *model.buffers()) if id(t) not in layers and mapped(t)]


@pytest.mark.parametrize("host", ["packed", "in_place"])
@pytest.mark.parametrize("name", SINGLE_FILE)
def test_the_loader_encodes_as_comfyui(name, host, te_names):
    expected = encodings(load(name, te_names))
    clip = load_in_the_files(name, te_names, **(IN_PLACE if host == "in_place" else {}))
    if host == "in_place":
        assert_layers_in_the_files(clip)
    else:
        stats = handle_of(clip).stats()
        assert stats["in_place_bytes"] == 0 and stats["packed_bytes"] > 0
    assert_identical(encodings(clip), expected)


@pytest.mark.parametrize("name", SINGLE_FILE)
def test_the_loader_leaves_the_layers_in_the_files_under_dynamic_vram(name, te_names, request):
    """With Dynamic VRAM's switch on, ComfyUI's Linear and Embedding take a clone of the file's tensor, not a copy
    into their own: the clone is deferred as the copy is."""
    expected = encodings(load(name, te_names))  # (ComfyUI's CLIPLoader with the switch on reads through comfy-aimdo)
    request.getfixturevalue("aimdo_switch")
    clip = load_in_the_files(name, te_names, **IN_PLACE)
    assert_layers_in_the_files(clip)
    assert_identical(encodings(clip), expected)


def test_a_deferred_copy_gives_way_to_what_comfyui_does_with_its_destination_later(tmp_path):
    """A recorded copy is made before any later use of its destination: a later write stands, a read sees the
    file's values, a write into a deferred clone writes its own memory, never the read-only mapping."""
    from safetensors.torch import save_file

    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": matrix}, str(tmp_path / "w.safetensors"))
    mapping = pack_module("offload_core").map_file(tmp_path / "w.safetensors")
    view = pack_module("nodes.safetensors_file").SafetensorsFile(str(tmp_path / "w.safetensors")).tensor(mapping, "w")
    written, read = torch.empty(3, 4), torch.empty(3, 4)
    deferred = pack_module("nodes.clip_loader")._DeferredCopies([mapping])
    with deferred:
        written.copy_(view)
        written.fill_(7.0)  # ComfyUI writes the destination again
        read.copy_(view)
        total = read.sum()
        cloned = view.clone()
        cloned[0] = -1.0
    deferred.make_copies()
    assert torch.equal(written, torch.full((3, 4), 7.0))
    assert total.item() == matrix.sum().item()
    assert torch.equal(cloned[0], torch.full((4,), -1.0)) and torch.equal(cloned[1:], matrix[1:])
    assert torch.equal(view, matrix)


def test_a_clip_loaded_again_builds_its_handle_once_for_its_own_settings(te_names, caplog):
    """Newest ComfyUI loads a model again through the loader (``cached_patcher_init``) and clones the patcher it
    gets: the clone builds the one handle, at its first load, with the settings of the node it came through."""
    from comfy.model_patcher import ModelPatcher

    if "force_deepcopy" not in inspect.signature(ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no deep clones")
    expected = encodings(load("qwen_image", te_names))
    clip = offloaded(load_in_the_files("qwen_image", te_names), SETTINGS["synchronous"])
    deep = clip.clone()
    with caplog.at_level(logging.INFO):
        deep.patcher = clip.patcher.clone(force_deepcopy=True)
        deep.cond_stage_model = deep.patcher.model
        assert deep.patcher.model is not clip.patcher.model
        assert pack_module("nodes.model_state").state_of(deep.patcher.model).handle is None  # nothing packed yet
        assert_identical(encodings(deep), expected)
    builds = [r for r in caplog.records if "of the blocks packed in host memory" in r.getMessage()]
    assert len(builds) == 1
    assert pack_module("nodes.handles").built_for(deep.patcher.model) == clip.patcher.offload_settings.handle_layout()


@pytest.mark.parametrize("name, whole", [("sdxl", ["clip_l"]), ("sd3_triple", ["clip_l", "clip_g"])])
def test_the_readout_names_the_encoders_loaded_whole(name, whole, te_names):
    clip = offloaded(load(name, te_names))
    encodings(clip)
    last = pack_module("nodes.telemetry").last_run(clip.patcher.model)
    assert last is not None and last["final"] and last["steps"] == 1
    assert [encoder for encoder, _ in last["left_whole"]] == whole
    assert last["streamed_groups"] == last["groups"] > 0


def test_sd3s_fp8_t5_streams_its_layers_at_one_byte_a_weight(te_names):
    """TripleCLIPLoader keeps the T5 in the dtype it reads from the weights (fp8, as t5xxl_fp8_e4m3fn): its layers
    are the blocks and stream at the file's size."""
    clip = offloaded(load("sd3_triple", te_names))
    text_encoders.encode_text(clip, PROMPTS[0])
    matrices = [p for block in clip.patcher.blocks() for p in block.parameters() if p.dim() >= 2]
    assert len(clip.patcher.blocks()) == text_encoders.ENCODERS["t5_xxl_4096"].tiny["num_layers"]
    assert {p.dtype for p in matrices} == {torch.float8_e4m3fn}
    assert handle_of(clip).stats()["streamed_bytes_per_pass"] <= sum(p.nbytes for p in matrices) * 1.05


def test_a_text_encoder_the_node_cannot_group_is_refused_naming_its_class(te_names, comfy_models):
    """An encoder whose embeddings hold most of its weights has no trunk of layers for the finder."""
    family = family_or_skip("wan")
    narrow = {**text_encoders.ENCODERS["umt5_xxl"].tiny, "d_ff": 128}
    source = text_encoders.cached_fixture("tiny_te_umt5_narrow", text_encoders.make_text_encoder, encoder="umt5_xxl",
                                          widths=narrow)
    target = comfy_models.models_dir / "text_encoders" / source.name
    if not target.exists():
        target.symlink_to(source)
    clip = node_output(family.loader, clip_name=source.name, type=family.type)
    with pytest.raises(ValueError, match="Group Offload \\(text encoder\\) does not know where WanTEModel"):
        offloaded(clip)
    with pytest.raises(ValueError, match="WanTEModel"):
        node_output("GroupOffloadCLIPLoader", clip_name=source.name, type=family.type, **STREAM_ALL)


def test_the_handle_goes_with_the_last_offloaded_clip(te_names):
    clip = load("qwen_image", te_names)
    clip_offloaded = offloaded(clip)
    encodings(clip_offloaded)
    state = pack_module("nodes.model_state").state_of(clip.patcher.model)
    assert state.handle() is not None and state.guards
    blocks = clip_offloaded.patcher.blocks()
    clone = node_output("CLIPSetLastLayer", clip=clip_offloaded, stop_at_clip_layer=-1)
    del clip_offloaded
    gc.collect()
    assert state.handle() is not None  # the clone still owns it
    del clone
    gc.collect()
    assert state.handle is None and not state.guards
    assert all(pack_module("offload_core").handle_of(block) is None for block in blocks)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_gguf_text_encoder_streams_at_its_quantized_size_and_encodes_as_comfyui_gguf(qtype, te_names, comfy_models):
    """ComfyUI-GGUF's CLIPLoader (GGUF) (a tiny Qwen3-4B, Z-Image's encoder, as llama.cpp names it) into the node."""
    from testbed import gguf_files

    if reason := gguf_files.comfyui_gguf_missing():
        pytest.skip(reason)
    gguf_files.load_comfyui_gguf(boot_comfyui_in_process())
    family = family_or_skip("z_image")
    source = text_encoders.text_encoder_gguf_file(qtype)
    target = comfy_models.models_dir / "text_encoders" / source.name
    if not target.exists():
        target.symlink_to(source)
    clip = node_output("CLIPLoaderGGUF", clip_name=source.name, type=family.type)
    expected = encodings(clip)
    clip_offloaded = offloaded(clip)
    assert_identical(encodings(clip_offloaded), expected)
    blocks = clip_offloaded.patcher.blocks()
    quantized = [p for block in blocks for p in block.parameters() if getattr(p, "tensor_type", None) is not None]
    assert quantized, "the layers are not ComfyUI-GGUF's quantized tensors"
    stats = handle_of(clip_offloaded).stats()
    raw = sum(torch.Tensor.nbytes.__get__(p) for block in blocks for p in block.parameters())
    assert stats["streamed_bytes_per_pass"] <= raw * 1.05  # at the file's size (the mirrors' alignment aside)
    formats = pack_module("nodes.telemetry").last_run(clip_offloaded.patcher.model)["formats"]
    assert f"GGUF {qtype}" in [name for name, _ in formats]  # (K-quants: the rows of 64 values are stored in F16)


@pytest.mark.parametrize("when", ["first", "later"])
@pytest.mark.parametrize("name", ["qwen_image", "flux"])
def test_an_interrupted_encode_leaves_nothing_behind_and_the_next_encodes_as_comfyui(name, when, te_names,
                                                                                     fake_cudart):
    """ComfyUI's interrupt (``interrupt_current_processing``; the next op of ``comfy.ops`` raises, a
    ``BaseException`` in 0.33) in the owning encoder's second layer, in the encode that learns the entries or in a
    later one: no watch stays on the torch function mode stack, no group's run and no telemetry run stays open,
    nothing more is pinned, the next encodes are ComfyUI's, and everything goes with the CLIP."""
    import comfy.model_management as mm

    expected = encodings(load(name, te_names))
    clip = offloaded(load(name, te_names))
    if when == "later":
        text_encoders.encode_text(clip, PROMPTS[1])
    hook = clip.patcher.blocks()[1].register_forward_pre_hook(lambda module, args: mm.interrupt_current_processing())
    with pytest.raises(mm.InterruptProcessingException):
        text_encoders.encode_text(clip, PROMPTS[0])
    hook.remove()
    handle, state = handle_of(clip), pack_module("nodes.model_state").state_of(clip.patcher.model)
    assert torch._C._len_torch_function_stack() == 0 and state.watch is None
    assert state.run is None and not any(handle.is_open(group) for group in handle.groups)
    streamed = sorted(group.mirror.buffer.nbytes for group in handle.groups if group.mirror.pinned)
    assert streamed and sorted(fake_cudart.registered.values()) == streamed
    assert_identical(encodings(clip), expected)
    assert pack_module("nodes.telemetry").last_run(clip.patcher.model)["final"]
    mm.unload_all_models()
    del clip, handle
    gc.collect()
    assert fake_cudart.registered_bytes == 0 == mm.TOTAL_PINNED_MEMORY
    assert torch._C._len_torch_function_stack() == 0
