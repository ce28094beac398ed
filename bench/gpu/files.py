"""Model files the size users run, written on the machine's local disk, streamed tensor by tensor so that a
20 GB file never sits in memory: ComfyUI's Qwen-Image as an fp8 ``.safetensors`` and as a GGUF (Q8_0, or Q4_K
from crafted blocks, as ``testbed/gguf_files.py`` crafts them), and any other model's tensors by their shapes (the
text-encoder family's Qwen2.5-VL-7B). The values are seeded and tiled from a pool
(``RandomWeights``; for GGUF, a pool of encoded blocks): their speed is what is measured, not their image."""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .config import BenchConfig
from .weights import RandomWeights, comfy_qwen_shapes

_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}
_POOL_ROWS = 4096  # rows of 256 values encoded once per GGUF type, tiled into every quantized tensor


def scratch_dir() -> Path:
    """Where the benchmark writes its model files: ``$BENCH_SCRATCH``, else the temporary folder (local disk)."""
    folder = Path(os.environ.get("BENCH_SCRATCH") or Path(tempfile.gettempdir()) / "group-offload-bench")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def disk_room(folder: Path, nbytes: int) -> str | None:
    """Why ``nbytes`` cannot be written in ``folder`` (with 2 GB to spare), or None."""
    free = shutil.disk_usage(folder).free
    return None if free > nbytes + 2 * 10**9 else f"{nbytes / 1e9:.1f} GB do not fit: {free / 1e9:.1f} GB free in {folder}"


def _tensor_dtype(shape: torch.Size, dtype: torch.dtype) -> torch.dtype:
    return dtype if len(shape) > 1 else torch.bfloat16  # as fp8 files keep 1-D tensors bf16


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


def write_safetensors(path: Path, config: BenchConfig, dtype: torch.dtype) -> dict[str, float]:
    """ComfyUI's Qwen-Image at ``config``'s size as a ``.safetensors`` in ``dtype``, fsynced; its size and the
    seconds the write took (to the disk, not the page cache)."""
    return write_shapes(path, comfy_qwen_shapes(config), dtype, config.pool_numel)


def write_shapes(path: Path, shapes: dict[str, torch.Size], dtype: torch.dtype, pool_numel: int) -> dict[str, float]:
    """A ``.safetensors`` of the tensors ``shapes`` in ``dtype`` (1-D ones bf16), seeded values tiled from a pool
    of ``pool_numel`` (``RandomWeights``), written tensor by tensor and fsynced; its size and the seconds it took."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        tensor_dtype = _tensor_dtype(shape, dtype)
        size = shape.numel() * tensor_dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor_dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    weights = RandomWeights(pool_numel)
    started = time.perf_counter()
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes.items():
            file.write(_bytes(weights.filled(name, shape, _tensor_dtype(shape, dtype))))
        file.flush()
        os.fsync(file.fileno())
    return {"bytes": path.stat().st_size, "write_s": time.perf_counter() - started}


def _gguf_tensors(config: BenchConfig, qtype: object) -> Iterator[tuple[str, torch.Size, object]]:
    """Each tensor's name, shape and stored type, as ComfyUI-GGUF's converter decides (testbed/gguf_files)."""
    from testbed.gguf_files import QType, keeps_full_precision

    for name, shape in comfy_qwen_shapes(config).items():
        yield name, shape, QType.F32 if keeps_full_precision(name, torch.empty(shape, device="meta")) else qtype


def _block_pool(qtype: object) -> np.ndarray:
    """Encoded blocks of ``qtype`` for ``_POOL_ROWS`` rows of 256 seeded values, flat bytes."""
    from testbed.gguf_files import encode

    values = torch.randn(_POOL_ROWS, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    return np.ascontiguousarray(encode(values, qtype, np.random.default_rng(0))[0]).reshape(-1)


def write_gguf(path: Path, config: BenchConfig, qtype: object) -> dict[str, float]:
    """ComfyUI's Qwen-Image at ``config``'s size as a GGUF file of ``qtype`` (1-D and small tensors F32),
    written tensor by tensor from a pool of encoded blocks, fsynced; its size and the seconds the write took."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    pool = _block_pool(qtype)
    weights = RandomWeights(config.pool_numel)
    writer = gguf.GGUFWriter(path=None, arch="qwen_image")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    planned = []
    for name, shape, stored in _gguf_tensors(config, qtype):
        if stored != qtype:
            planned.append((name, weights.filled(name, shape, torch.float32).numpy(), None))
            writer.add_tensor_info(name, tuple(shape), np.dtype(np.float32), shape.numel() * 4)
            continue
        rows = (shape.numel() // shape[-1], shape[-1]) if shape[-1] % block == 0 else (shape.numel() // 256, 256)
        if rows[1] != shape[-1]:
            writer.add_array(f"comfy.gguf.orig_shape.{name}", list(shape))
        byte_shape = (rows[0], rows[1] // block * type_size)
        planned.append((name, byte_shape, stored))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=stored)
    started = time.perf_counter()
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, stored in planned:
        writer.write_tensor_data(data if stored is None else np.resize(pool, data))
    writer.fout[0].flush()
    os.fsync(writer.fout[0].fileno())
    writer.close()
    return {"bytes": path.stat().st_size, "write_s": time.perf_counter() - started}


def gguf_size(config: BenchConfig, qtype: object) -> int:
    """The tensor bytes of :func:`write_gguf`'s file (its header is a few hundred kB more)."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return sum(shape.numel() * 4 if stored != qtype else shape.numel() // block * type_size
               for _, shape, stored in _gguf_tensors(config, qtype))


def safetensors_size(config: BenchConfig, dtype: torch.dtype) -> int:
    return shapes_size(comfy_qwen_shapes(config), dtype)


def shapes_size(shapes: dict[str, torch.Size], dtype: torch.dtype) -> int:
    """The tensor bytes of :func:`write_shapes`' file of ``shapes`` in ``dtype``."""
    return sum(shape.numel() * _tensor_dtype(shape, dtype).itemsize for shape in shapes.values())


def use_folder_for_models(folder: Path, kind: str = "diffusion_models") -> None:
    """Make the in-process ComfyUI's loaders of ``kind`` (and ComfyUI-GGUF's, which share the list) find files in
    ``folder``."""
    import folder_paths

    if str(folder) not in folder_paths.get_folder_paths(kind):
        folder_paths.add_model_folder_path(kind, str(folder), is_default=True)
