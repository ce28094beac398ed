"""Tiny GGUF diffusion models as ComfyUI-GGUF's Unet Loader (GGUF) reads them, written at test time with
``gguf.GGUFWriter``, and ComfyUI-GGUF itself where a test needs it.

The layout is the one ComfyUI-GGUF's ``loader.gguf_sd_loader`` reads, as its ``tools/convert.py`` and its
patched ``llama-quantize`` write it: the model's own ComfyUI keys as tensor names (no prefix),
``general.architecture`` one of its image architectures (``qwen_image``, ``flux``, ``wan``), each tensor stored
whole in ggml's dimension order. A tensor whose last dimension the type's block does not divide is stored in F16,
as llama-quantize falls back for the K-quants (convert.py writes ``comfy.gguf.orig_shape`` rows of 256 values for
SD1/SDXL only, never for these DiTs); 5-D tensors (Wan's patch embedding) are stored whole in F32, as its
``fix_5d_tensors.py`` does.

The values come from the tiny models the other tests use (:data:`SOURCES`): the four-block tiny Qwen-Image
of ``fixture_models`` and the tiny Flux and Wan 2.1 T2V of ``dit_families`` (16 latent channels). How a
tensor is stored:

- F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (:data:`QUANTIZER_TYPES`): ``gguf.quants.quantize`` of the
  tensor's values;
- Q2_K … Q6_K, IQ4_NL, IQ4_XS (:data:`CRAFTED_TYPES`), and the types ComfyUI-GGUF dequantizes with gguf-py's
  numpy code, on the host (:data:`HOST_DEQUANTIZED_TYPES`: IQ1_S, IQ2_*, IQ3_*, TQ1_0, TQ2_0): gguf-py has no
  quantizer for them, so the blocks are crafted: a seeded random payload whose fp16 super-block scales (``d``,
  and ``dmin`` where the type has one) are set so that the dequantized tensor has mean ~0 and the source
  tensor's standard deviation. Their values are not the source's, only its scale; ``gguf.quants.dequantize``
  checks that they are finite;
- any other type (:data:`UNKNOWN_TYPE`, for the bad-input tests): random bytes in its block layout.

API: :func:`write_gguf` ``(path, state_dict, policy, arch)``; :func:`write_tiny_gguf` ``(path, model, policy)``
for a model of :data:`SOURCES`; a policy is a :class:`gguf.GGMLQuantizationType` (as ComfyUI-GGUF's
converter: 1-D, 5-D and small tensors F32, the rest that type; :func:`converter_policy`), or any
``(key, tensor) -> type``; :func:`mixed_policy` cycles through types (:data:`COMFYUI_GGUF_TYPES`, every
type ComfyUI-GGUF dequantizes with torch, puts them all in one file). :func:`comfyui_gguf_missing`,
:func:`load_comfyui_gguf` (in this process) and :func:`link_comfyui_gguf` (for a server's base directory)
bring in ComfyUI-GGUF as ``dev.py setup`` unpacked it into the ComfyUI in use.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Union

import numpy as np
import torch

from testbed.comfy_boot import comfyui_path, run_maybe_async
from testbed.fixture_models import FIXTURE_CACHE, link_or_copy_dir, tiny_qwen_image_file, widen_qwen_detection

COMFYUI_GGUF = "ComfyUI-GGUF"

try:
    import gguf
    from gguf import GGMLQuantizationType as QType
except ImportError:  # comfyui_gguf_missing() says so; nothing here is usable then
    gguf = None
    QType = None

if gguf is not None:
    FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
    QUANTIZER_TYPES = (*FLOAT_TYPES, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)
    # Byte offsets of each block's fp16 scales: d, then dmin where the type has one (ggml's block layouts).
    _FP16_SCALES = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
                    QType.Q6_K: (208,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,)}
    CRAFTED_TYPES = tuple(_FP16_SCALES)
    COMFYUI_GGUF_TYPES = (*QUANTIZER_TYPES, *CRAFTED_TYPES)
    # The types ComfyUI-GGUF has no torch dequantizer for: it falls back to gguf-py's numpy one, on the host.
    _HOST_FP16_SCALES = {QType.IQ1_S: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,), QType.IQ2_S: (0,),
                         QType.IQ3_XXS: (0,), QType.IQ3_S: (0,), QType.TQ1_0: (52,), QType.TQ2_0: (64,)}
    HOST_DEQUANTIZED_TYPES = tuple(_HOST_FP16_SCALES)
    _FP16_SCALES |= _HOST_FP16_SCALES
    # A type a GGUF file can hold and ComfyUI-GGUF loads, but that neither it nor gguf-py dequantizes.
    UNKNOWN_TYPE = QType.Q8_1

Policy = Union["QType", Callable[[str, torch.Tensor], "QType"]]

# ComfyUI-GGUF's converter keeps tensors of at most this many values in F32 (tools/convert.py).
_QUANTIZATION_THRESHOLD = 1024
# write_gguf's unused tensor: in no block and no layer, ComfyUI leaves it out of the model (an unexpected key).
UNUSED_TENSOR = "unused_padding"
UNUSED_ROW_BYTES = 4096


# --------------------------------------------------------------------------------------------
# ComfyUI-GGUF in the ComfyUI in use
# --------------------------------------------------------------------------------------------

def comfyui_gguf_dir() -> Path:
    return comfyui_path() / "custom_nodes" / COMFYUI_GGUF


def comfyui_gguf_missing() -> str | None:
    """Why the GGUF tests cannot run here (a reason to skip with), or None."""
    if gguf is None:
        return "the gguf package is not installed (python3 dev.py setup installs it)"
    if not (comfyui_gguf_dir() / "__init__.py").is_file():
        return (f"ComfyUI-GGUF is not in {comfyui_gguf_dir().parent} (python3 dev.py setup unpacks it from "
                "../shared/comfyui-gguf/)")
    return None


def load_comfyui_gguf(nodes_module: ModuleType) -> None:
    """Load ComfyUI-GGUF into the ComfyUI booted in this process, as ComfyUI loads a custom node; idempotent."""
    if "UnetLoaderGGUF" in nodes_module.NODE_CLASS_MAPPINGS:
        return
    loaded = run_maybe_async(nodes_module.load_custom_node(str(comfyui_gguf_dir()), module_parent="custom_nodes"))
    if not loaded or "UnetLoaderGGUF" not in nodes_module.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI could not load {comfyui_gguf_dir()}; see the log above")


def link_comfyui_gguf(base_dir: Path) -> None:
    """Put ComfyUI-GGUF into ``base_dir/custom_nodes`` so that a server on that base directory loads it."""
    link_or_copy_dir(comfyui_gguf_dir(), Path(base_dir) / "custom_nodes" / COMFYUI_GGUF)


# --------------------------------------------------------------------------------------------
# Encoding tensors
# --------------------------------------------------------------------------------------------

def block_size(qtype: QType) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def _set_scales(blocks: np.ndarray, qtype: QType, values: Iterable[float]) -> None:
    for offset, value in zip(_FP16_SCALES[qtype], values):
        blocks[:, offset:offset + 2] = np.full((len(blocks), 1), value, np.float16).view(np.uint8)


def _dequantized(blocks: np.ndarray, qtype: QType, scales: Iterable[float]) -> np.ndarray:
    _set_scales(blocks, qtype, scales)
    return gguf.quants.dequantize(blocks, qtype)


def random_blocks(values: np.ndarray, qtype: QType, generator: np.random.Generator) -> np.ndarray:
    """Random bytes in ``qtype``'s block layout for ``values``: what crafted blocks start from, and as they are
    the data of a type nothing here dequantizes (:data:`UNKNOWN_TYPE`)."""
    size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return generator.integers(0, 256, (*values.shape[:-1], values.shape[-1] // size * type_size), dtype=np.uint8)


def craft_blocks(values: np.ndarray, qtype: QType, generator: np.random.Generator) -> np.ndarray:
    """Blocks of ``qtype`` for ``values`` (last dimension a multiple of its block size): a random payload
    scaled to the values' standard deviation, mean ~0; uint8 rows of the quantized bytes."""
    blocks = random_blocks(values, qtype, generator).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    scale_count = len(_FP16_SCALES[qtype])
    dmin = 0.0
    if scale_count == 2:  # what d adds and what dmin takes away, on average: make them cancel
        added, taken = _dequantized(blocks, qtype, (1, 0)).mean(), -_dequantized(blocks, qtype, (0, 1)).mean()
        dmin = float(added / taken) if taken else 0.0
    spread = float(_dequantized(blocks, qtype, (1, dmin)).std()) or 1.0
    scale = (float(values.std()) or 1.0) / spread
    check = _dequantized(blocks, qtype, (scale, dmin * scale)[:scale_count])
    if not np.isfinite(check).all():
        raise ValueError(f"crafted {qtype.name} blocks dequantize to non-finite values")
    return blocks.reshape(*values.shape[:-1], -1)


def holds(qtype: QType, tensor: torch.Tensor) -> bool:
    """Whether ``qtype``'s blocks divide ``tensor``'s rows (its last dimension)."""
    return tensor.shape[-1] % block_size(qtype) == 0


def encode(tensor: torch.Tensor, qtype: QType, generator: np.random.Generator) -> tuple[np.ndarray, QType]:
    """The data GGUFWriter stores for ``tensor`` as ``qtype``, and the type it is stored as: F16 where
    ``qtype``'s blocks do not divide its rows, as llama-quantize falls back."""
    values = tensor.detach().to(torch.float32).cpu().numpy()
    if not holds(qtype, tensor):
        qtype = QType.F16
    if qtype in _FP16_SCALES:
        return craft_blocks(values, qtype, generator), qtype
    if qtype in QUANTIZER_TYPES:
        return gguf.quants.quantize(values, qtype), qtype
    return random_blocks(values, qtype, generator), qtype


# --------------------------------------------------------------------------------------------
# Policies and files
# --------------------------------------------------------------------------------------------

def keeps_full_precision(key: str, tensor: torch.Tensor) -> bool:
    """What ComfyUI-GGUF's converter keeps in F32: 1-D and small tensors, more than 4 dimensions, Wan's
    modulations (loaded as nn.Parameter)."""
    return (tensor.dim() <= 1 or tensor.dim() > 4 or tensor.numel() <= _QUANTIZATION_THRESHOLD
            or key.endswith(".modulation"))


def converter_policy(qtype: QType) -> Callable[[str, torch.Tensor], QType]:
    """``qtype`` for every tensor but those :func:`keeps_full_precision` keeps in F32."""
    return lambda key, tensor: QType.F32 if keeps_full_precision(key, tensor) else qtype


def mixed_policy(qtypes: Iterable[QType]) -> Callable[[str, torch.Tensor], QType]:
    """The types in turn over the tensors ComfyUI-GGUF's converter would quantize (F32 for the others): each
    tensor the least used of the types whose blocks divide its rows, the largest blocks first (fewer rows fit
    them); with :data:`COMFYUI_GGUF_TYPES` one file holds every type once the model has enough tensors of each
    row length."""
    used = dict.fromkeys(qtypes, 0)

    def choose(key: str, tensor: torch.Tensor) -> QType:
        if keeps_full_precision(key, tensor):
            return QType.F32
        fitting = [q for q in used if holds(q, tensor)] or list(used)
        qtype = min(fitting, key=lambda q: (used[q], -block_size(q)))
        used[qtype] += 1
        return qtype
    return choose


def write_gguf(path: Path, state_dict: dict[str, torch.Tensor], policy: Policy, arch: str, seed: int = 0,
               unused_bytes: int = 0) -> Path:
    """Write ``state_dict`` (ComfyUI's keys) as a GGUF diffusion model of architecture ``arch``, each
    tensor as ``policy`` says (a type is :func:`converter_policy` of it), whole or not at all.

    ``unused_bytes`` (whole rows of :data:`UNUSED_ROW_BYTES`) adds :data:`UNUSED_TENSOR`, F32, as the last
    tensor, its data never written: a hole at the file's end (``truncate``), so that a file bigger than the
    machine's memory takes no disk."""
    choose = converter_policy(policy) if isinstance(policy, QType) else policy
    generator = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, tensor in state_dict.items():
        data, qtype = encode(tensor, choose(key, tensor), generator)
        writer.add_tensor(key, data, raw_dtype=qtype)
    rows = unused_bytes // UNUSED_ROW_BYTES
    if rows:
        writer.add_tensor_info(UNUSED_TENSOR, (rows, UNUSED_ROW_BYTES // 4), np.dtype(np.float32),
                               rows * UNUSED_ROW_BYTES)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer.write_header_to_file(path=partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for info in list(writer.tensors[0].values())[:len(state_dict)]:
        writer.write_tensor_data(info.tensor)  # aligned, as write_tensors_to_file places them
    end = writer.fout[0].tell()
    writer.close()
    os.truncate(partial, end + rows * UNUSED_ROW_BYTES)
    os.replace(partial, path)
    return path


def stored_types(path: Path) -> dict[str, QType]:
    """Each tensor's type as stored in the GGUF file at ``path``."""
    return {tensor.name: QType(tensor.tensor_type) for tensor in gguf.GGUFReader(path).tensors}


# --------------------------------------------------------------------------------------------
# The tiny models
# --------------------------------------------------------------------------------------------

def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _qwen_image() -> dict[str, torch.Tensor]:
    widen_qwen_detection()
    return _load_safetensors(tiny_qwen_image_file(num_layers=4))


def _stand_in(name: str) -> Callable[[], dict[str, torch.Tensor]]:
    def source() -> dict[str, torch.Tensor]:
        from testbed import dit_families

        path = FIXTURE_CACHE / f"gguf_source_{name}.{os.getpid()}.safetensors"
        dit_families.save_tiny_file(getattr(dit_families, name), path)  # makes ComfyUI detect the model in this process
        try:
            return _load_safetensors(path)
        finally:
            path.unlink()
    return source


# A model's GGUF architecture and its tensors (ComfyUI's keys; ComfyUI detects it in this process).
SOURCES: dict[str, tuple[str, Callable[[], dict[str, torch.Tensor]]]] = {
    "qwen_image": ("qwen_image", _qwen_image),
    "flux": ("flux", _stand_in("FLUX")),
    "wan": ("wan", _stand_in("WAN_T2V")),
}


def write_tiny_gguf(path: Path, model: str = "qwen_image", policy: Policy | None = None, seed: int = 0) -> Path:
    """The tiny ``model`` of :data:`SOURCES` as a GGUF file (Q8_0 by default), loadable by Unet Loader (GGUF)
    in this process once it is written."""
    arch, source = SOURCES[model]
    return write_gguf(path, source(), QType.Q8_0 if policy is None else policy, arch, seed)
