"""Bytes a quantized Qwen-Image block streams per pass, per comfy-kitchen layout, against bf16.

One block with exactly the tensors of ComfyUI's ``QwenImageTransformerBlock`` (see
``hook_overhead.py``), its Linear weights quantized with comfy-kitchen's own quantizer into each
layout that runs on the CPU, packed by the engine: the host mirror holds, and each pass copies, the
quantized data and every scale (aligned), never the dequantized weight. Needs comfy-kitchen (the
0.33.0 venv has it): ``.venv-0.33.0/bin/python bench/quantized_bytes.py [--narrow N]``.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path)
from hook_overhead import QwenLikeModel, quantize_linears
from offload_core import apply_group_offload
from reporting import markdown_table

log = logging.getLogger("quantized_bytes")

#: ComfyUI's comfy_quant format -> comfy-kitchen layout and quantizer options.
LAYOUTS: dict[str, tuple[str, dict[str, object]]] = {
    "float8_e4m3fn": ("TensorCoreFP8Layout", {}),
    "float8_e5m2": ("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    "int8_tensorwise": ("TensorWiseINT8Layout", {}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
    "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", {}),
    "asym_w4a8_int8": ("AsymW4A8Int8Layout", {}),
}


def streamed_bytes(narrow: int, fmt: str | None) -> int:
    """The bytes one pass copies for one block (every group streamed)."""
    model = QwenLikeModel(1, narrow)  # (values do not matter: bytes are counted)
    if fmt is not None:
        layout, options = LAYOUTS[fmt]
        quantize_linears(model, layout, **options)
    handle = apply_group_offload(model, list(model.transformer_blocks), "cpu", pin_memory=False)
    streamed = handle.stats()["streamed_bytes_per_pass"]
    handle.remove()
    return streamed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--narrow", type=int, default=1, help="1/N of the real width (default 1: the real block)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    bf16 = streamed_bytes(args.narrow, None)
    rows = [["bf16 (unquantized)", f"{bf16 / 1e6:,.1f}", "1.000"]]
    for fmt in LAYOUTS:
        nbytes = streamed_bytes(args.narrow, fmt)
        rows.append([fmt, f"{nbytes / 1e6:,.1f}", f"{nbytes / bf16:.3f}"])
        log.info("%s: %.1f MB per block and pass", fmt, nbytes / 1e6)
    print(f"Qwen-Image block at 1/{args.narrow} width, Linear weights quantized (norms and biases bf16):\n")
    print(markdown_table(["format", "MB streamed per block and pass", "÷ bf16"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
