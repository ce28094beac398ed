"""ComfyUI-GGUF's models through the node, on real ComfyUI with ComfyUI-GGUF loaded: through KSampler the latent
is bit-identical to the same GGUF model without the node (Qwen-Image, Flux and Wan 2.1 files holding every type
ComfyUI-GGUF dequantizes); the weights stream as their GGUF bytes and stay ``GGMLTensor``s; a LoRA before and
after the node is ComfyUI-GGUF's (hung on the quantized weights, added as they dequantize); the groups past a
host budget are gathered from the ``.gguf`` file's pages, and a file changed under them fails the run clearly.
The bit-exact and LoRA tests run as "cpu" and "cuda" (the test bed's ``device`` fixture): the GPU machine runs the
same flow."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from testbed import gguf_files
from testbed.comfy_boot import boot_comfyui_in_process
from testbed.pack_modules import pack_module
from testbed.run_nodes import node_output
from testbed.node_runs import DEVICES
from testbed.gguf_runs import (
    DEVICE_APART,
    MODELS,
    expected,
    file_name,
    load_gguf,
    offload,
    offload_handle,
    sample,
    with_lora,
)

pytestmark = pytest.mark.skipif(gguf_files.comfyui_gguf_missing() is not None,
                                reason=str(gguf_files.comfyui_gguf_missing()))

SETTINGS = {
    "stream_all_p0": {"prefetch": 0},
    "stream_all_p1": {},
    "stream_all_p2_bpg2": {"prefetch": 2, "blocks_per_group": 2},
    "budget": {"residency": "budget", "resident_gb": 1e-5},
    "auto": {"residency": "auto"},
}


def test_the_files_hold_every_type_comfyui_gguf_dequantizes_f16_fallbacks_and_5d_tensors(gguf_models):
    """As convert.py and llama-quantize write DiTs: no ``orig_shape`` rows (convert.py writes them for SD1/SDXL
    only); a tensor whose rows a K-quant cannot hold stays F16, whole."""
    path = gguf_models / file_name("qwen_image")
    assert set(gguf_files.stored_types(path).values()) >= set(gguf_files.COMFYUI_GGUF_TYPES)
    assert not any(name.startswith("comfy.gguf.orig_shape.") for name in gguf_files.gguf.GGUFReader(path).fields)
    wan = gguf_files.gguf.GGUFReader(gguf_models / file_name("wan")).tensors
    assert any(len(t.shape) == 5 for t in wan), "Wan's 5-D patch embedding"
    q4_k = gguf_files.write_tiny_gguf(gguf_models / "tiny_qwen_image_q4_k.gguf", policy=gguf_files.QType.Q4_K)
    quantized = [t for t in gguf_files.gguf.GGUFReader(q4_k).tensors if t.tensor_type != gguf_files.QType.F32]
    stored = {(int(t.shape[0]) % 256 == 0, gguf_files.QType(t.tensor_type)) for t in quantized}  # (ggml: rows first)
    assert stored == {(True, gguf_files.QType.Q4_K), (False, gguf_files.QType.F16)}, "rows Q4_K cannot hold: F16"
    assert torch.equal(sample(offload(node_output("UnetLoaderGGUF", unet_name=q4_k.name)), "qwen_image"),
                       sample(node_output("UnetLoaderGGUF", unet_name=q4_k.name), "qwen_image"))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("kind", MODELS)
def test_bit_identical_to_comfyui_gguf_streamed_as_the_gguf_bytes(gguf_models, kind, settings, device):
    packed_nbytes = pack_module("offload_core").packed_nbytes
    model = offload(load_gguf(kind), **SETTINGS[settings])
    assert torch.equal(sample(model, kind), expected(kind))
    assert torch.equal(sample(model, kind), expected(kind)), "and again, from the same host copies"
    handle = offload_handle(model)
    stored = {t.name: int(t.n_bytes) for t in gguf_files.gguf.GGUFReader(gguf_models / file_name(kind)).tensors}
    quantized = [(b.qualname, b.current()) for g in handle.groups for b in g.bindings
                 if type(b.current()).__name__ == "GGMLTensor"]
    assert len(quantized) > len(handle.groups), "the blocks' weights are ComfyUI-GGUF's still"
    for name, weight in quantized:
        assert packed_nbytes(weight) == stored[name.removeprefix("diffusion_model.")], f"{name}: its GGUF bytes"
        assert weight.tensor_type is not None and len(weight.shape) >= 1
    stats = handle.stats()
    if settings.startswith("stream_all"):
        assert stats["streamed_bytes_per_pass"] == stats["host_bytes"] == sum(g.nbytes for g in handle.groups)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_lora_before_and_after_the_node_is_comfyui_ggufs_and_a_strength_change_reloads_nothing(gguf_models, device):
    kind = "qwen_image"
    plain = load_gguf(kind)
    assert not torch.equal(expected(kind, 0.8), expected(kind)), "the LoRA changes the result"
    assert torch.equal(sample(offload(with_lora(plain)), kind), expected(kind, 0.8)), "a LoRA before the node"
    offloaded = offload(plain)
    assert isinstance(offloaded, type(plain)), "ComfyUI-GGUF's patcher is still behind the node's"
    after = with_lora(offloaded)
    assert torch.equal(sample(after, kind), expected(kind, 0.8)), "a LoRA after the node"
    handle = offload_handle(after)
    mirrors = [g.mirror.buffer.data_ptr() for g in handle.groups]
    assert torch.equal(sample(with_lora(offloaded, 0.4), kind), expected(kind, 0.4)), "another strength"
    assert offload_handle(offloaded) is handle and [g.mirror.buffer.data_ptr() for g in handle.groups] == mirrors, \
        "a strength change reloads nothing"
    assert torch.equal(sample(offloaded, kind), expected(kind)), "without the LoRA, its patches are gone"
    assert torch.equal(sample(after, kind), expected(kind, 0.8))
    assert torch.equal(sample(plain, kind), expected(kind)), "the node bypassed: ComfyUI-GGUF's own patcher on the model"


@pytest.fixture
def compute_dtype_reported(gguf_models, monkeypatch):
    """ComfyUI-GGUF's ``GGMLTensor`` reporting, as its newer versions do (ops.py at 8e0d9cad), the dtype a quantized
    weight computes in (float16; bfloat16 for BF16) instead of its storage's uint8; F32 and F16 report their own."""
    QType = gguf_files.QType
    ggml_tensor = type(next(w for w in load_gguf("qwen_image").model.parameters() if hasattr(w, "tensor_type")))
    storage_dtype = torch.Tensor.dtype.__get__

    def dtype(tensor: torch.Tensor) -> torch.dtype:
        tensor_type = getattr(tensor, "tensor_type", None)
        if tensor_type in (None, QType.F32, QType.F16):
            return storage_dtype(tensor)
        return torch.bfloat16 if tensor_type == QType.BF16 else torch.float16

    monkeypatch.setattr(ggml_tensor, "dtype", property(dtype), raising=False)
    return ggml_tensor


def test_a_lora_applies_where_ggmltensor_reports_its_compute_dtype(compute_dtype_reported):
    kind = "qwen_image"
    reference = sample(with_lora(load_gguf(kind)), kind)
    quantized = [w for w in load_gguf(kind).model.parameters() if isinstance(w, compute_dtype_reported)
                 and w.tensor_type not in gguf_files.FLOAT_TYPES]
    assert quantized and all(w.dtype.is_floating_point for w in quantized), "its quantized weights report a float dtype"
    assert not torch.equal(reference, sample(load_gguf(kind), kind)), "the LoRA changes ComfyUI-GGUF's result"
    assert torch.equal(sample(offload(with_lora(load_gguf(kind))), kind), reference), "a LoRA before the node"
    assert torch.equal(sample(with_lora(offload(load_gguf(kind))), kind), reference), "a LoRA after the node"


def patch_tensors(value) -> list[torch.Tensor]:
    """The tensors of a ComfyUI weight patch (or a list of them), adapters' weights included."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in patch_tensors(item)]
    weights = getattr(value, "weights", None)  # a WeightAdapterBase (LoRA, LoHa...)
    return patch_tensors(weights) if weights is not None else []


@dataclass
class PatchCopies:
    forwards: int = 0
    copies: int = 0
    bytes: int = 0  # of the LoRA's host tensors moved to the device during the forwards


BLOCKS = "diffusion_model.transformer_blocks."  # the tiny Qwen-Image's blocks


def host_block_patches(model) -> dict[int, torch.Tensor]:
    """The tensors of ``model``'s patches of block weights, as the LoRA loader left them on the host, by id."""
    return {id(t): t for t in patch_tensors([p for key, p in model.patches.items() if key.startswith(BLOCKS)])}


@contextlib.contextmanager
def host_patch_copies(model) -> Iterator[PatchCopies]:
    """Count what the diffusion model's forwards move to the device of ``model``'s patches of block weights as
    the LoRA loader left them on the host: ComfyUI-GGUF's move of a quantized weight's patches as it dequantizes
    it, and ComfyUI's casts (its LoRA adapters cast their tensors to the weight's device)."""
    import comfy.model_management as mm

    host = host_block_patches(model)
    ops = sys.modules[boot_comfyui_in_process().NODE_CLASS_MAPPINGS["UnetLoaderGGUF"].__module__.replace(".nodes", ".ops")]
    counts, in_forward = PatchCopies(), [False]

    def counted(move):
        def moved(tensor, *args, **kwargs):
            if in_forward[0] and isinstance(tensor, torch.Tensor) and id(tensor) in host:
                counts.copies += 1
                counts.bytes += tensor.nbytes
            return move(tensor, *args, **kwargs)
        return moved

    def enter(*_):
        counts.forwards += 1
        in_forward[0] = True

    diffusion_model = model.model.diffusion_model
    hooks = [diffusion_model.register_forward_pre_hook(enter),
             diffusion_model.register_forward_hook(lambda *_: in_forward.__setitem__(0, False))]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(ops, "move_patch_to_device", counted(ops.move_patch_to_device))
        monkeypatch.setattr(mm, "cast_to_device", counted(mm.cast_to_device))
        try:
            yield counts
        finally:
            for hook in hooks:
                hook.remove()


@pytest.mark.parametrize("highvram", [False, True], ids=["normal_vram", "highvram"])
def test_a_loras_patches_go_to_the_device_once_per_load_and_back_with_its_memory(gguf_models, highvram):
    """The patches of quantized weights: on the device once per load (the memory the plan counts for them), not
    copied there at every forward; on the host again once that memory is given back. ``highvram``: ComfyUI's offload
    device is the GPU, as --highvram and --gpu-only make it, where ComfyUI-GGUF alone keeps its patches."""
    kind = "qwen_image"
    plain = load_gguf(kind)
    plain.load_device = DEVICE_APART
    if highvram:
        plain.offload_device = DEVICE_APART
    alone = with_lora(plain)
    with host_patch_copies(alone) as copied:
        assert torch.equal(sample(alone, kind), expected(kind, 0.8))
    assert copied.forwards and copied.bytes > 0, "ComfyUI-GGUF alone copies its LoRA adapters at every forward"
    for order, model in [("before", offload(with_lora(plain), residency="auto")), ("after", with_lora(offload(plain)))]:
        with host_patch_copies(model) as copied:
            assert torch.equal(sample(model, kind), expected(kind, 0.8)), f"a LoRA {order} the node"
        assert copied.forwards and copied.bytes == 0, f"a LoRA {order} the node: {copied}"
        host = host_block_patches(model)
        quantized = [w for g in offload_handle(model).groups for w in (b.current() for b in g.bindings)
                     if getattr(w, "patches", None)]
        assert quantized and not any(id(t) in host for w in quantized for t in patch_tensors(w.patches))
        assert model.partially_unload(model.offload_device, memory_to_free=1) > 0
        assert all(id(t) in host for w in quantized for t in patch_tensors(w.patches)), \
            "the device memory given back, the patches hang on the host"


def test_a_deep_copy_of_a_gguf_model_is_refused_naming_a_loader_that_reads_gguf(gguf_models):
    """Unet Loader (GGUF) cannot load its model again: the refusal names the GGUF loader that can."""
    model = offload(load_gguf("qwen_image"))
    assert getattr(model, "cached_patcher_init", None) is None
    with pytest.raises(ValueError, match=r"cannot be deep-copied .*\.gguf file, ComfyUI-GGUF's Unet Loader "
                                         r"\(Dynamic VRAM\)"):
        model.clone(force_deepcopy=True)


@pytest.mark.parametrize("advanced", [
    {"dequant_dtype": "float32", "patch_dtype": "float16", "patch_on_device": False},
    {"dequant_dtype": "default", "patch_dtype": "target", "patch_on_device": True},
], ids=["patch_dtype_float16", "patch_on_device"])
def test_the_advanced_loaders_patch_options_hold_through_the_node(gguf_models, advanced):
    kind = "qwen_image"
    model = with_lora(offload(load_gguf(kind, **advanced)))
    assert model.patch_on_device is advanced["patch_on_device"]
    assert torch.equal(sample(model, kind), expected(kind, 0.8, **advanced))


def test_groups_past_the_host_budget_are_gathered_from_the_gguf_files_pages(gguf_models):
    kind = "flux"
    packed = offload(load_gguf(kind), host_memory="auto")
    assert torch.equal(sample(packed, kind), expected(kind))
    block_bytes = offload_handle(packed).stats()["host_bytes"]
    assert offload_handle(packed).stats()["in_place_bytes"] == 0, "auto: the RAM holds this tiny model whole"
    del packed
    for share in (0.0, 0.5):
        host_gb = (pack_module("nodes.handles").packed_host_bytes() + share * block_bytes) / 1024**3
        model = offload(load_gguf(kind), host_memory="budget", host_gb=host_gb)
        assert torch.equal(sample(model, kind), expected(kind))
        stats = offload_handle(model).stats()
        assert stats["in_place_bytes"] == block_bytes - stats["packed_bytes"] > 0
        assert (stats["packed_bytes"] > 0) is (share > 0)
        assert stats["file_backed_bytes"] > 0.9 * stats["in_place_bytes"], "views of the .gguf file's mapping"
        assert stats["gathered_bytes"] > 0


def test_past_the_page_cache_room_the_gguf_files_pages_are_read_around_it(gguf_models, monkeypatch):
    """A GGUF model kept in place with page cache for a third of it: the first third is kept cached and the rest
    is read around the page cache at each gather (where the file system reads so); the latent is ComfyUI-GGUF's
    alone."""
    kind = "flux"
    memory, hostmem = pack_module("nodes.memory"), pack_module("offload_core.hostmem")
    model = offload(load_gguf(kind), host_memory="budget", host_gb=0.0)
    monkeypatch.setattr(pack_module("nodes.patcher"), "page_cache_room", lambda handle, base_model: memory.HostRoom(
        handle.stats()["in_place_bytes"] // 3, "a third of the model"))
    read_around = []
    read_around_cache = hostmem.FilePages.read_around_cache
    monkeypatch.setattr(hostmem.FilePages, "read_around_cache",
                        lambda pages, target, tensor, skip: (read_around.append(target.numel() - skip),
                                                             read_around_cache(pages, target, tensor, skip))[1])
    assert torch.equal(sample(model, kind), expected(kind))
    handle = offload_handle(model)
    if not all(g.mirror.reads_around_cache for g in handle.groups):
        pytest.skip("the file system of the test's models has no direct reads (O_DIRECT)")
    stats = handle.stats()
    assert stats["kept_cached_bytes"] == stats["in_place_bytes"] // 3, "nothing set aside for the group in flight"
    released = [g for g in handle.groups if g.mirror.cached_bytes == 0]
    # (which pages stay cached is tests/core's to check: in a file this small, the pages faulted in for the kept
    # part bring their neighbours along, in folios that cannot be dropped in part)
    assert released and sum(read_around) >= 2 * sum(g.nbytes for g in released) * 0.9, "each step, around the cache"


def test_a_gguf_file_changed_under_the_mapped_model_fails_the_run_clearly(gguf_models):
    source_changed = pack_module("offload_core").SourceChangedError
    path = gguf_models / "changed_under_the_model.gguf"
    path.write_bytes((gguf_models / file_name("qwen_image")).read_bytes())
    original = path.read_bytes()
    model = offload(node_output("UnetLoaderGGUF", unet_name=path.name), host_memory="budget", host_gb=0.0)
    assert torch.equal(sample(model, "qwen_image"), expected("qwen_image"))
    with open(path, "r+b") as file:
        file.truncate(len(original) // 2)
    try:
        with pytest.raises(source_changed, match=r"changed_under_the_model\.gguf is now"):
            sample(model, "qwen_image")
    finally:
        with open(path, "r+b") as file:
            file.write(original)
    with pytest.raises(source_changed, match="was written to since"):
        sample(model, "qwen_image")  # (its bytes are not compared: refused until loaded again)
    again = offload(node_output("UnetLoaderGGUF", unet_name=path.name), host_memory="budget", host_gb=0.0)
    assert torch.equal(sample(again, "qwen_image"), expected("qwen_image")), "loaded again, it runs"


def test_the_readout_names_the_gguf_types_and_counts_the_gguf_bytes_per_step(gguf_models):
    kind = "qwen_image"
    model = offload(load_gguf(kind), prefetch=0)  # (no group copied ahead past the last step)
    sample(model, kind)
    run = pack_module("nodes.telemetry").last_run(model.model)
    reader = gguf_files.gguf.GGUFReader(gguf_models / file_name(kind))
    in_blocks = {f"GGUF {gguf_files.QType(t.tensor_type).name}" for t in reader.tensors
                 if t.name.startswith("transformer_blocks.")
                 and not (t.tensor_type == gguf_files.QType.BF16 and len(t.shape) == 1)}  # (loaded as float32)
    assert {name for name, _ in run["formats"]} == in_blocks
    host_bytes = offload_handle(model).stats()["host_bytes"]
    assert sum(nbytes for _, nbytes in run["formats"]) <= host_bytes, "their GGUF bytes"
    assert run["bytes_per_step"] == run["streamed_bytes_per_pass"] == host_bytes, "one pass a step, at the GGUF size"
    assert run["host_dequantized_bytes_per_pass"] == 0, "every type here has ComfyUI-GGUF's torch dequantizer"


def test_types_dequantized_on_the_host_run_as_without_the_node_and_the_readout_counts_their_bytes(gguf_models):
    """IQ1_S, IQ2_*, IQ3_*, TQ*: ComfyUI-GGUF dequantizes them with gguf-py's numpy code, copying the weight to the
    host at every forward; they run, and the readout counts their bytes as going to the host every pass."""
    policy = gguf_files.mixed_policy((*gguf_files.HOST_DEQUANTIZED_TYPES, gguf_files.QType.Q8_0))
    path = gguf_files.write_tiny_gguf(gguf_models / "host_dequantized_types.gguf", policy=policy)
    reader = gguf_files.gguf.GGUFReader(path)
    on_the_host = {t.name: int(t.n_bytes) for t in reader.tensors
                   if t.tensor_type in gguf_files.HOST_DEQUANTIZED_TYPES and t.name.startswith("transformer_blocks.")}
    assert len({gguf_files.QType(t.tensor_type) for t in reader.tensors} & set(gguf_files.HOST_DEQUANTIZED_TYPES)) > 4
    plain = sample(node_output("UnetLoaderGGUF", unet_name=path.name), "qwen_image")
    model = offload(node_output("UnetLoaderGGUF", unet_name=path.name))
    assert torch.equal(sample(model, "qwen_image"), plain)
    run = pack_module("nodes.telemetry").last_run(model.model)
    assert on_the_host and run["host_dequantized_bytes_per_pass"] == sum(on_the_host.values())


def test_a_forward_that_fails_leaves_nothing_pinned_and_the_error_is_comfyui_ggufs(gguf_models, fake_cudart):
    """A block weight of a type ComfyUI-GGUF does not dequantize: its bytes stream as any others, and the
    sampler fails as without the node, with nothing left pinned."""
    unknown, weight = gguf_files.UNKNOWN_TYPE, "transformer_blocks.1.img_mlp.net.2.weight"
    converter = gguf_files.converter_policy(gguf_files.QType.Q8_0)
    path = gguf_files.write_tiny_gguf(gguf_models / "unknown_type.gguf", policy=lambda key, tensor: (
        unknown if key == weight else converter(key, tensor)))
    with pytest.raises(Exception) as plain:
        sample(node_output("UnetLoaderGGUF", unet_name=path.name), "qwen_image")
    model = offload(node_output("UnetLoaderGGUF", unet_name=path.name))
    with pytest.raises(type(plain.value), match=unknown.name):
        sample(model, "qwen_image")
    assert fake_cudart.registered_bytes == 0
