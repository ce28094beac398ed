"""The file tier (issue 32): a model file bigger than this machine's RAM + swap loads through the Group
Offload loader, and the mapped files are checked by what they are, also where stat and /proc/self/maps
disagree on their device and inode (overlayfs).

The big file is sparse: a small model's tensors, then one unused tensor written as a hole (``truncate``),
so that it takes no disk and is never read; Linux refuses a private writable mapping of it (commit limit).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from offload_core import SourceChangedError, apply_group_offload, hostmem
from testbed.fixture_models import ModelDir, tiny_qwen_image_file
from testbed.pack_modules import pack_module
from testbed.quantized_files import QUANT_FORMATS, BLOCK_PREFIX, cpu_skip_reason, quantize_state_dict, source_qwen_file
from testbed.run_nodes import run_node, run_txt2img
from testbed.core_models import mapped_pair
from testbed.node_runs import OFFLOAD_DEFAULTS
from testbed.host_budget_driver import ram_and_swap_bytes, sample_small_and_big

MODEL = {"num_layers": 4, "dtype": torch.float32}  # float32: what ComfyUI computes in on the CPU
SMALL_NAME, BIG_NAME = "file_tier_small.safetensors", "file_tier_bigger_than_ram.safetensors"
QUANTIZED_NAME = "file_tier_fp8_outside_the_blocks_too.safetensors"
PADDING_KEY = "unused_padding"  # in no block and no layer: ComfyUI ignores it as an unexpected key
ROW_BYTES = 4096


def write_padded(source: Path, target: Path, padding_bytes: int) -> None:
    """``source``'s tensors, then ``PADDING_KEY``: float32 rows of ``padding_bytes`` in all, a hole."""
    with source.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        data = f.read()
    rows = padding_bytes // ROW_BYTES
    header[PADDING_KEY] = {"dtype": "F32", "shape": [rows, ROW_BYTES // 4],
                           "data_offsets": [len(data), len(data) + rows * ROW_BYTES]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with target.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)
        f.truncate(8 + len(encoded) + len(data) + rows * ROW_BYTES)


@pytest.fixture(scope="module")
def files(comfy_models: ModelDir, tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    small = tiny_qwen_image_file(**MODEL)
    big = tmp_path_factory.mktemp("file_tier") / BIG_NAME
    write_padded(small, big, ram_and_swap_bytes() + 2**30)
    folder = comfy_models.models_dir / "diffusion_models"
    for name, path in ((SMALL_NAME, small), (BIG_NAME, big)):
        if not (folder / name).exists():
            (folder / name).symlink_to(path)
    return comfy_models


def test_a_file_bigger_than_ram_and_swap_loads_and_samples_as_comfyui_on_its_weights(files, tmp_path):
    big = files.models_dir / "diffusion_models" / BIG_NAME
    assert big.stat().st_size > ram_and_swap_bytes() and big.stat().st_blocks * 512 < 2**30, "sparse, bigger than RAM"
    sample_small_and_big(files, tmp_path, SMALL_NAME, BIG_NAME, "loader")


def quantized_outside_the_blocks(models: ModelDir) -> str:
    """The four-block Qwen-Image in fp8 mixed precision, its Linears outside the blocks too: newest ComfyUI's
    quantized layers keep the state dict's tensors as their own."""
    from safetensors.torch import load_file, save_file

    if cpu_skip_reason("float8_e4m3fn"):
        pytest.skip(cpu_skip_reason("float8_e4m3fn"))
    target = models.models_dir / "diffusion_models" / QUANTIZED_NAME
    if not target.exists():
        tensors, metadata = quantize_state_dict(load_file(source_qwen_file()), QUANT_FORMATS["float8_e4m3fn"],
                                                blocks=(BLOCK_PREFIX, "img_in.", "proj_out."))
        save_file(tensors, str(target), metadata=metadata)
    return target.name


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "fp8_outside_the_blocks_too"])
def test_only_the_block_tensors_stay_in_the_read_only_mapping(files, quantized):
    """ComfyUI may patch the weights outside the blocks in place (weight hooks): none of them is a view of
    the file's read-only mapping, where a write would fault; the blocks' tensors all are."""
    hostmem, blocks = pack_module("offload_core.hostmem"), pack_module("nodes.blocks")
    name = quantized_outside_the_blocks(files) if quantized else SMALL_NAME
    with torch.inference_mode():  # as in a prompt
        model = run_node("GroupOffloadLoader", unet_name=name, weight_dtype="default",
                         **OFFLOAD_DEFAULTS, host_memory="budget", host_gb=0.0).outputs[0]
    diffusion_model, mappings = model.model.diffusion_model, hostmem.FileMappings()
    mapped = {id(part) for part in tensor_parts([diffusion_model]) if mappings.find(part)}
    assert mapped and mapped <= {id(part) for part in tensor_parts(blocks.find_blocks(diffusion_model))}


def tensor_parts(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The tensors that hold the modules' bytes (a quantized weight's data and scales)."""
    flatten = pack_module("offload_core").flatten
    return [part for module in modules for t in (*module.parameters(), *module.buffers()) for part in flatten(t)[1]]


def test_a_shrunk_file_is_refused_where_stat_and_the_maps_disagree_on_its_inode(tmp_path, monkeypatch):
    """overlayfs (Docker) lists the underlying file's device and inode in /proc/self/maps, and stat shows its
    own: the check must still see the file shrink (reading past its end would kill the process, SIGBUS)."""
    _, offloaded, _ = mapped_pair(tmp_path)
    path = tmp_path / "blocks.bin"
    monkeypatch.setattr(hostmem, "PROC_MAPS", as_overlayfs_lists(path, tmp_path / "maps"))
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", host_budget=0)
    assert handle.stats()["file_backed_bytes"] > 0
    handle.check_sources()
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(SourceChangedError, match=r"blocks\.bin is now \d+ bytes on disk"):
        handle.check_sources()
    handle.remove()


def as_overlayfs_lists(path: Path, copy: Path) -> Path:
    """A copy of /proc/self/maps (written to ``copy``) in which ``path``'s mappings have another device and
    inode than stat gives for it, as overlayfs lists them."""
    stat = path.stat()
    lines = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path) and int(fields[4]) == stat.st_ino:
            fields[3:5] = [f"{os.major(stat.st_dev) + 1:02x}:{os.minor(stat.st_dev):02x}", str(stat.st_ino + 1)]
            line = " ".join(fields)
        lines.append(line)
    copy.write_text("\n".join(lines) + "\n")
    return copy


def test_released_pages_leave_the_page_cache(tmp_path):
    path = tmp_path / "pages.bin"
    path.write_bytes(bytes(range(256)) * 2**16)  # 16 MiB (the kernel may cache a file in folios of up to 2 MiB)
    with path.open("rb") as file:
        os.fsync(file.fileno())  # clean pages: what a model file's are
    mapping = hostmem.map_file(path)
    half = mapping.numel() // 2
    assert int(mapping.sum()) > 0 and hostmem.uncached_bytes(mapping) == 0  # read: all in the page cache
    sources = hostmem.SourceFiles()  # (holds the file open, as a handle's do)
    first = mapping[:half]
    sources.add(hostmem.FileMappings().find(first), first).release(first)
    assert hostmem.uncached_bytes(mapping[:half]) == half
    assert hostmem.uncached_bytes(mapping[half:]) == 0, "only the released range leaves"


def test_the_bytes_kept_cached_are_the_first_that_fit_the_room():
    assert hostmem.bytes_kept_cached([10] * 6, 35) == [10, 10, 10, 5, 0, 0], "the next group's leading part"
    assert hostmem.bytes_kept_cached([10, 30, 10], 25) == [10, 15, 0]
    assert hostmem.bytes_kept_cached([10] * 3, 30) == [10] * 3
    assert hostmem.bytes_kept_cached([10] * 3, 0) == hostmem.bytes_kept_cached([10] * 3, -5) == [0] * 3


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn"])
def test_a_lora_on_blocks_left_in_the_read_only_file_samples_as_comfyui(files, weight_dtype):
    """On the CPU the device is the host: the LoRA is computed into the slabs the groups are gathered into,
    ComfyUI patches the weights outside the blocks (memory of their own), and an fp8 weight_dtype converts the
    blocks into memory of their own; the file's read-only pages are never written (a write would kill the
    process)."""
    from testbed.lora_fixture import make_lora

    lora = make_lora(tiny_qwen_image_file(**MODEL), files.models_dir / "loras" / "file_tier_lora.safetensors").name

    def with_lora(model):
        return run_node("LoraLoaderModelOnly", model=model, lora_name=lora, strength_model=0.8).outputs[0]

    with torch.inference_mode():  # as in a prompt
        plain = run_node("UNETLoader", unet_name=SMALL_NAME, weight_dtype=weight_dtype).outputs[0]
        ours = run_node("GroupOffloadLoader", unet_name=SMALL_NAME, weight_dtype=weight_dtype,
                        **OFFLOAD_DEFAULTS, host_memory="budget", host_gb=0.0).outputs[0]
        expected = run_txt2img(with_lora(plain), seed=3).latent
        assert not torch.equal(expected, run_txt2img(plain, seed=3).latent), "the LoRA must change the result"
        assert torch.equal(run_txt2img(with_lora(ours), seed=3).latent, expected)
        assert torch.equal(run_txt2img(ours, seed=3).latent, run_txt2img(plain, seed=3).latent), "unpatched again"


def test_weight_hooks_on_the_blocks_are_refused_before_they_write(files, tmp_path):
    """ComfyUI writes a conditioning's weight hooks (Create Hook LoRA) into the weights in place; a block's are
    read-only pages of the file here (a write would kill the process): the run fails at the sampler instead."""
    import comfy.hooks
    import comfy.utils
    from testbed.lora_fixture import make_lora
    from testbed.run_nodes import make_test_conditioning, qwen_joint_dim

    lora = comfy.utils.load_torch_file(str(make_lora(tiny_qwen_image_file(**MODEL), tmp_path / "lora.safetensors")))
    with torch.inference_mode():  # as in a prompt
        model = run_node("GroupOffloadLoader", unet_name=SMALL_NAME, weight_dtype="default",
                         **OFFLOAD_DEFAULTS, host_memory="budget", host_gb=0.0).outputs[0]
        joint_dim = qwen_joint_dim(model)
        hooked = comfy.hooks.set_hooks_for_conditioning(make_test_conditioning(1, joint_dim=joint_dim),
                                                        comfy.hooks.create_hook_lora(lora, 1.0, 1.0))
        with pytest.raises(ValueError, match=r"cannot apply weight hooks .*LoraLoaderModelOnly"):
            run_txt2img(model, steps=1, positive=hooked, negative=make_test_conditioning(2, joint_dim=joint_dim))
