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

from testbed import gguf_files
from testbed.host_budget_driver import ram_and_swap_bytes, sample_small_and_big

pytestmark = pytest.mark.skipif(gguf_files.comfyui_gguf_missing() is not None,
                                reason=str(gguf_files.comfyui_gguf_missing()))

SMALL_NAME, BIG_NAME = "gguf_file_tier_small.gguf", "gguf_file_tier_bigger_than_ram.gguf"


@pytest.fixture(scope="module")
def files(comfy_models):
    """The tiny Qwen-Image as a Q8_0 ``.gguf``, alone and followed by an unused tensor past RAM + swap."""
    arch, source = gguf_files.SOURCES["qwen_image"]
    state_dict = source()
    folder = comfy_models.models_dir / "diffusion_models"
    gguf_files.write_gguf(folder / SMALL_NAME, state_dict, gguf_files.QType.Q8_0, arch)
    gguf_files.write_gguf(folder / BIG_NAME, state_dict, gguf_files.QType.Q8_0, arch,
                          unused_bytes=ram_and_swap_bytes() + 2**30)
    return comfy_models


def test_a_gguf_bigger_than_ram_and_swap_streams_and_samples_as_comfyui_gguf_on_its_weights(files, tmp_path):
    big = files.models_dir / "diffusion_models" / BIG_NAME
    unused = gguf_files.gguf.GGUFReader(big).tensors[-1]
    assert unused.name == gguf_files.UNUSED_TENSOR and unused.n_bytes > ram_and_swap_bytes()
    assert big.stat().st_blocks * 512 < 2**30, "sparse"
    sample_small_and_big(files, tmp_path, SMALL_NAME, BIG_NAME, "node", gguf=True)
