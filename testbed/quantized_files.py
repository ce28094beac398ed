"""Quantized tiny Qwen-Image files in ComfyUI's own on-disk formats, generated at test time.

Each file is the four-block tiny Qwen-Image of :func:`fixture_models.tiny_qwen_image_file` with the 2-D
``.weight`` of every Linear inside ``transformer_blocks`` quantized (norms, biases and everything
outside the blocks stay bf16), written with real safetensors and cached per format and ComfyUI version
in ``.cache/fixtures``. The quantized data comes from the running ComfyUI's own quantizer:
``comfy.quant_ops.QuantizedTensor.from_float`` (comfy-kitchen on newest ComfyUI) and, where it has
one, its ``state_dict(prefix)``; nothing is hand-packed.

API:

- ``QUANT_FORMATS``: name -> :class:`QuantFormat`, the on-disk conventions:

  - ``scaled_fp8``, ``scaled_fp8_input_scale``: the old ``*_fp8_scaled`` files, a top-level
    ``scaled_fp8`` marker, float8_e4m3fn weights and ``<layer>.scale_weight`` (and ``<layer>.scale_input``
    = 0.5 in the second). Newest ComfyUI rewrites them at load (``comfy.utils.convert_old_quants``);
    0.3.75 runs them with its ``scaled_fp8_ops``.
  - ``float8_e4m3fn``, ``float8_e5m2``, ``int8_tensorwise``, ``mxfp8``, ``nvfp4``, ``convrot_w4a4``,
    ``asym_w4a8_int8``: mixed precision as newest ComfyUI saves it, a ``<layer>.comfy_quant`` uint8 JSON
    tensor per quantized layer beside the scale keys ``comfy/ops.py _load_quantized_module`` reads.
    ``mxfp8`` stores its block scales as F8_E8M0, ``mxfp8_uint8_scales`` as uint8 (ComfyUI views them).
  - ``float8_e4m3fn_attention_only``: the same, but only the attention Linears are quantized; the
    MLPs and modulations stay bf16.
  - ``float8_e4m3fn_metadata``: the layers named in a ``_quantization_metadata`` safetensors header
    instead of ``comfy_quant`` tensors: what ComfyUI 0.3.75 saves and the only mixed precision it reads;
    newest ComfyUI turns the header into ``comfy_quant`` tensors at load.

- :func:`quantize_state_dict` ``(tensors, fmt, blocks)``: any model's tensors quantized as ``fmt`` says.
- :func:`quantized_qwen_file` ``(name) -> Path``: the cached file; raises :class:`FormatUnavailable`
  when the running ComfyUI has no quantizer for the format. :func:`source_qwen_file`: the bf16 original.
- the ``quantized_models`` fixture: every format this ComfyUI samples on the CPU linked into its
  diffusion_models folder as :func:`unet_name` ``(name)``, and a LoRA of the bf16 original (``node_runs.LORA``);
  :func:`load_plain`, :func:`offload`, :func:`load_offloaded`, :func:`with_lora` run the nodes on them.
- :func:`cpu_skip_reason` ``(name, version) -> str | None``: why plain ComfyUI ``version`` cannot load
  and sample the format on the CPU (``None``: it can); :func:`formats_runnable_on_cpu` ``(version)``.
  What was found, with ComfyUI's own errors, is in ``NOT_ON_CPU``.

What plain ComfyUI makes of them on the CPU (the files loaded inside ``torch.inference_mode()``, as in a
prompt; loaded outside it, newest ComfyUI's ``.to()`` of a QuantizedTensor fails at sampling with
"Cannot set version_counter for inference tensor"):

- 0.33.0: every format. Each quantized block Linear is a ``MixedPrecisionOps.Linear`` whose weight is a
  ``Parameter`` wrapping a comfy-kitchen ``QuantizedTensor`` of the format's ``QUANT_ALGOS`` layout,
  compute dtype float32. fp8, mxfp8 and nvfp4 run dequantized ("emulated"); int8_tensorwise,
  convrot_w4a4 and asym_w4a8_int8 run comfy-kitchen's eager kernels. A LoRA is merged into the
  weights and requantized at load, and undone afterwards.
- 0.3.75: ``scaled_fp8*`` (``scaled_fp8_op.Linear``: a float8_e4m3fn Parameter beside a
  ``scale_weight``; this op also rounds the bf16 Linears outside the blocks to fp8) and
  ``float8_e4m3fn_metadata`` (``MixedPrecisionOps.Linear`` with ComfyUI's own ``QuantizedTensor``,
  layout ``TensorCoreFP8Layout``); nothing else (see ``NOT_ON_CPU``).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from testbed.comfy_boot import comfyui_version, prepare_comfy_import
from testbed.fixture_models import ModelDir, cached_fixture, tiny_qwen_image_file
from testbed.lora_fixture import make_lora
from testbed.node_runs import LORA
from testbed.run_nodes import node_output

logger = logging.getLogger(__name__)

NUM_LAYERS = 4
BLOCK_PREFIX = "transformer_blocks."
# The tiny model's Linears are 64 or 256 wide; ConvRot rotates groups of input features (256 by
# default, which a 64-wide layer cannot hold), so the rotating layouts use 64-feature groups.
_CONVROT_GROUP = 64
# A calibrated input scale as the old scaled-fp8 files carry one (1.0 means "none" to ComfyUI).
SCALE_INPUT = 0.5

Layers = Literal["all", "attention"]
Container = Literal["scaled_fp8", "comfy_quant", "metadata"]


class FormatUnavailable(RuntimeError):
    """The running ComfyUI has no quantizer (layout) for the requested format."""


@dataclass(frozen=True)
class QuantFormat:
    """One quantized-file variant: how its weights are quantized and how the file says so.

    ``quant_format`` is the ``QUANT_ALGOS`` key (the ``comfy_quant`` JSON ``format``);
    ``quantize_kwargs`` go to ``from_float``; ``layer_conf`` is added to the ``comfy_quant`` JSON
    (what ComfyUI's own ``state_dict`` writes for the layout); ``uint8_block_scales`` stores the
    block scales as uint8 bytes.
    """

    container: Container
    quant_format: str
    layers: Layers = "all"
    quantize_kwargs: dict[str, object] = field(default_factory=dict)
    layer_conf: dict[str, object] = field(default_factory=dict)
    scale_input: float | None = None
    uint8_block_scales: bool = False

    def quantizes(self, key: str, shape: Sequence[int], blocks: tuple[str, ...] = (BLOCK_PREFIX,)) -> bool:
        """Whether the file quantizes the source tensor ``key`` of this shape, the blocks' keys starting
        with one of ``blocks``."""
        in_blocks = key.startswith(blocks) and key.endswith(".weight") and len(shape) == 2
        return in_blocks and (self.layers == "all" or ".attn." in key)


_RECALCULATE = {"scale": "recalculate"}  # an absmax scale, as ComfyUI's set_weight requantizes
_CONVROT = {"convrot_groupsize": _CONVROT_GROUP}

QUANT_FORMATS: dict[str, QuantFormat] = {
    "scaled_fp8": QuantFormat("scaled_fp8", "float8_e4m3fn", quantize_kwargs=_RECALCULATE),
    "scaled_fp8_input_scale": QuantFormat("scaled_fp8", "float8_e4m3fn", quantize_kwargs=_RECALCULATE,
                                          scale_input=SCALE_INPUT),
    "float8_e4m3fn": QuantFormat("comfy_quant", "float8_e4m3fn", quantize_kwargs=_RECALCULATE),
    "float8_e5m2": QuantFormat("comfy_quant", "float8_e5m2", quantize_kwargs=_RECALCULATE),
    "int8_tensorwise": QuantFormat("comfy_quant", "int8_tensorwise"),
    "mxfp8": QuantFormat("comfy_quant", "mxfp8"),
    "mxfp8_uint8_scales": QuantFormat("comfy_quant", "mxfp8", uint8_block_scales=True),
    "nvfp4": QuantFormat("comfy_quant", "nvfp4"),
    "convrot_w4a4": QuantFormat("comfy_quant", "convrot_w4a4", quantize_kwargs=_CONVROT, layer_conf=_CONVROT),
    "asym_w4a8_int8": QuantFormat("comfy_quant", "asym_w4a8_int8", quantize_kwargs=_CONVROT,
                                  layer_conf={"group_size": 16, **_CONVROT}),
    "float8_e4m3fn_attention_only": QuantFormat("comfy_quant", "float8_e4m3fn", layers="attention",
                                                quantize_kwargs=_RECALCULATE),
    "float8_e4m3fn_metadata": QuantFormat("metadata", "float8_e4m3fn", quantize_kwargs=_RECALCULATE),
}

_COMFY_QUANT_IGNORED = ("ComfyUI 0.3.75 reads mixed precision only from a _quantization_metadata header and "
                        "ignores comfy_quant tensors: the quantized weights load as plain float32 without their "
                        "scales (hundreds to thousands of times too large), and sampling gives a finite but "
                        "wrong latent")


def _no_layout(quant_format: str, outcome: str) -> str:
    return f"ComfyUI 0.3.75 has no {quant_format} layout; a file from newest ComfyUI {outcome}"


_UNSCALED = "loads its weights as plain float32 without their scales and samples a wrong latent"
_PACKED = ("does not load: its packed 4-bit weights have half the width (\"size mismatch for "
           "transformer_blocks.0.img_mod.1.weight: copying a param with shape torch.Size([384, 32]) from "
           "checkpoint, the shape in current model is torch.Size([384, 64])\")")

# What plain ComfyUI cannot load and sample on the CPU, by version (found by running it); every other
# format loads into ComfyUI's quantized ops, samples finite and bit-identical latents and takes a LoRA.
NOT_ON_CPU: dict[str, dict[str, str]] = {
    "0.3.75": {
        "float8_e4m3fn": _COMFY_QUANT_IGNORED,
        "float8_e4m3fn_attention_only": _COMFY_QUANT_IGNORED,
        "float8_e5m2": _no_layout("float8_e5m2", "loads its weights as plain float32 without their scales "
                                                 "and samples a latent with NaNs"),
        "int8_tensorwise": _no_layout("int8_tensorwise", _UNSCALED),
        "mxfp8": _no_layout("mxfp8", _UNSCALED),
        "mxfp8_uint8_scales": _no_layout("mxfp8", _UNSCALED),
        "nvfp4": _no_layout("nvfp4", _PACKED),
        "convrot_w4a4": _no_layout("convrot_w4a4", _PACKED),
        "asym_w4a8_int8": _no_layout("asym_w4a8_int8", _PACKED),
    },
}


def cpu_skip_reason(name: str, version: str | None = None) -> str | None:
    """Why plain ComfyUI ``version`` (default: the one in use) cannot sample ``name`` on the CPU."""
    if name not in QUANT_FORMATS:
        raise KeyError(f"unknown quantized format {name!r}; known: {', '.join(QUANT_FORMATS)}")
    return NOT_ON_CPU.get(version or comfyui_version(), {}).get(name)


def formats_runnable_on_cpu(version: str | None = None) -> list[str]:
    """The formats plain ComfyUI ``version`` (default: the one in use) loads and samples on the CPU."""
    return [name for name in QUANT_FORMATS if cpu_skip_reason(name, version) is None]


def _quantizer(fmt: QuantFormat) -> Callable[[torch.Tensor, str], dict[str, torch.Tensor]]:
    """``(bf16 weight, "<layer>.weight") -> {key: tensor}`` with the running ComfyUI's quantizer."""
    prepare_comfy_import()
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    if fmt.quant_format not in QUANT_ALGOS:
        raise FormatUnavailable(f"ComfyUI {comfyui_version()} has no {fmt.quant_format!r} layout "
                                f"(its QUANT_ALGOS: {', '.join(QUANT_ALGOS)})")
    layout = QUANT_ALGOS[fmt.quant_format]["comfy_tensor_layout"]

    def quantize(weight: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        if hasattr(QuantizedTensor, "state_dict"):
            return QuantizedTensor.from_float(weight, layout, **fmt.quantize_kwargs).state_dict(prefix)
        # ComfyUI 0.3.75's own QuantizedTensor (float8_e4m3fn only, absmax-scaled by default) has no
        # state_dict; these are the keys its loader reads.
        qt = QuantizedTensor.from_float(weight, layout)
        return {prefix: qt._qdata, f"{prefix}_scale": qt._layout_params["scale"]}

    return quantize


def _comfy_quant_tensor(conf: dict[str, object]) -> torch.Tensor:
    """A ``comfy_quant`` entry as ComfyUI writes it: the JSON's UTF-8 bytes as a uint8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def quantize_state_dict(tensors: dict[str, torch.Tensor], fmt: QuantFormat,
                        blocks: tuple[str, ...] = (BLOCK_PREFIX,)) -> tuple[dict[str, torch.Tensor], dict | None]:
    """``tensors`` (bf16, ComfyUI's keys) with the Linears of the blocks under ``blocks`` quantized as ``fmt``
    says, as a file holds them: the tensors and the safetensors metadata."""
    quantize = _quantizer(fmt)
    conf = {"format": fmt.quant_format, **fmt.layer_conf}
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, object]] = {}
    for key, weight in tensors.items():
        if not fmt.quantizes(key, weight.shape, blocks):
            out[key] = weight
            continue
        layer = key.removesuffix(".weight")
        quantized = quantize(weight, key)
        if fmt.uint8_block_scales:
            quantized[f"{key}_scale"] = quantized[f"{key}_scale"].view(torch.uint8)
        if fmt.container == "scaled_fp8":
            quantized[f"{layer}.scale_weight"] = quantized.pop(f"{key}_scale")
            if fmt.scale_input is not None:
                quantized[f"{layer}.scale_input"] = torch.tensor(fmt.scale_input, dtype=torch.float32)
        elif fmt.container == "comfy_quant":
            quantized[f"{layer}.comfy_quant"] = _comfy_quant_tensor(conf)
        layers[layer] = conf
        out.update(quantized)
    metadata = None
    if fmt.container == "scaled_fp8":
        out["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    elif fmt.container == "metadata":
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    logger.info("quantized %d block Linears as %s (%s)", len(layers), fmt.quant_format, fmt.container)
    return {key: value.contiguous() for key, value in out.items()}, metadata


def make_quantized_qwen_image(path: Path, fmt: QuantFormat, source: Path) -> Path:
    """Write ``source`` (a bf16 tiny Qwen-Image) with its block Linears quantized as ``fmt`` says."""
    with safe_open(str(source), framework="pt") as f:
        tensors, metadata = quantize_state_dict({key: f.get_tensor(key) for key in f.keys()}, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)
    return path


def source_qwen_file() -> Path:
    """The bf16 four-block tiny Qwen-Image every quantized file is made from (and a LoRA can be)."""
    return tiny_qwen_image_file(num_layers=NUM_LAYERS)


def quantized_qwen_file(name: str) -> Path:
    """The four-block tiny Qwen-Image quantized as ``name`` (a key of ``QUANT_FORMATS``), cached."""
    if name not in QUANT_FORMATS:
        raise KeyError(f"unknown quantized format {name!r}; known: {', '.join(QUANT_FORMATS)}")
    # The quantizer is the running ComfyUI's, so each version gets its own file.
    return cached_fixture(f"tiny_qwen_image_{name}-comfyui-{comfyui_version()}", make_quantized_qwen_image,
                   fmt=QUANT_FORMATS[name], source=source_qwen_file())


OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


def unet_name(fmt: str) -> str:
    return f"quantized_{fmt}.safetensors"


@pytest.fixture(scope="module")
def quantized_models(comfy_models: ModelDir) -> ModelDir:
    """Links every format this ComfyUI samples on the CPU into its diffusion_models folder, and a LoRA."""
    folder = comfy_models.models_dir / "diffusion_models"
    for name in formats_runnable_on_cpu():
        target = folder / unet_name(name)
        if not target.exists():
            target.symlink_to(quantized_qwen_file(name))
    make_lora(source_qwen_file(), comfy_models.models_dir / "loras" / LORA)
    return comfy_models


def load_plain(fmt: str):
    return node_output("UNETLoader", unet_name=unet_name(fmt), weight_dtype="default")


def offload(model, **options):
    return node_output("GroupOffload", model=model, **(OFFLOAD | options))


def load_offloaded(fmt: str, **options):
    return node_output("GroupOffloadLoader", unet_name=unet_name(fmt), weight_dtype="default", **(OFFLOAD | options))


def with_lora(model, strength: float = 0.8):
    return node_output("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=strength)
