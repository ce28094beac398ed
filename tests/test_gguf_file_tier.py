"""The file tier for GGUF (issue 32): a ``.gguf`` bigger than this machine's RAM + swap loads through
ComfyUI-GGUF's Unet Loader (GGUF) and streams through Group Offload with nothing packed, sampling
bit-identically to ComfyUI-GGUF alone on the same weights, in a fresh process.

The big file is sparse: the tiny Qwen-Image's tensors (Q8_0), then one unused F32 tensor as a hole
(``gguf_files.write_gguf``'s ``unused_bytes``), never read. ComfyUI-GGUF's reader maps the file read-only
(a numpy memmap in mode ``r``: a shared mapping, not charged against the commit limit), so a file past
RAM + swap opens; ComfyUI leaves the unused tensor out of the model (an unexpected key).
"""
from __future__ import annotations

import pytest
import torch

import gguf_files
import host_budget_driver
from pack_modules import pack_module
from test_file_tier import ram_and_swap_bytes

pytestmark = pytest.mark.skipif(gguf_files.comfyui_gguf_missing() is not None,
                                reason=str(gguf_files.comfyui_gguf_missing()))

SMALL_NAME, BIG_NAME = "gguf_file_tier_small.gguf", "gguf_file_tier_bigger_than_ram.gguf"
ONE_GIB = 2**30


@pytest.fixture(scope="module")
def files(comfy_models):
    """The tiny Qwen-Image as a Q8_0 ``.gguf``, alone and followed by an unused tensor past RAM + swap."""
    arch, source = gguf_files.SOURCES["qwen_image"]
    state_dict = source()
    folder = comfy_models.models_dir / "diffusion_models"
    gguf_files.write_gguf(folder / SMALL_NAME, state_dict, gguf_files.QType.Q8_0, arch)
    gguf_files.write_gguf(folder / BIG_NAME, state_dict, gguf_files.QType.Q8_0, arch,
                          unused_bytes=ram_and_swap_bytes() + ONE_GIB)
    return comfy_models


def unused_tensor_pages(path) -> torch.Tensor:
    """The unused tensor's bytes in a read-only mapping of the file at ``path`` (mapped, not read)."""
    reader = gguf_files.gguf.GGUFReader(path)
    unused = reader.tensors[-1]
    assert unused.name == gguf_files.UNUSED_TENSOR
    return pack_module("offload_core.hostmem").map_file(path)[unused.data_offset:]


def anon_peak(run: dict) -> int:
    """The process's peak anonymous memory over a driver run."""
    return max(mark["peak"] for mark in run["rss_anon"].values())


def test_a_gguf_bigger_than_ram_and_swap_streams_and_samples_as_comfyui_gguf_on_its_weights(files, tmp_path):
    big = files.models_dir / "diffusion_models" / BIG_NAME
    unused = unused_tensor_pages(big)
    assert unused.numel() > ram_and_swap_bytes() and big.stat().st_blocks * 512 < ONE_GIB, "sparse, bigger than RAM"
    spec = {"models": str(files.base_dir), "steps": 2, "gguf": True}
    plain = host_budget_driver.run_in_fresh_process(
        {**spec, "unet_name": SMALL_NAME, "via": "plain", "latent": str(tmp_path / "plain.pt")})
    ours = host_budget_driver.run_in_fresh_process(
        {**spec, "unet_name": BIG_NAME, "via": "node", "latent": str(tmp_path / "ours.pt"),
         "offload": {"host_memory": "budget", "host_gb": 0.0}})
    stats = ours["calls"][-1]
    assert stats["packed_bytes"] == 0 and stats["in_place_bytes"] == stats["host_bytes"] > 0
    assert ours["call_read_bytes"] and max(ours["call_read_bytes"]) < ONE_GIB
    # A hole costs no read from storage (read_bytes): a read of it shows as zeroed pages in the page cache,
    # a copy of it as anonymous memory.
    hostmem = pack_module("offload_core.hostmem")
    assert unused.numel() - hostmem.uncached_bytes(unused) < ONE_GIB, "the unused tensor is never read"
    assert anon_peak(ours) < anon_peak(plain) + ONE_GIB
    assert torch.equal(torch.load(tmp_path / "ours.pt"), torch.load(tmp_path / "plain.pt"))
