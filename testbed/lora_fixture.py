"""Random LoRAs for a fixture diffusion model or text encoder, in ComfyUI's generic key formats."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def make_lora(model_file: Path, path: Path, rank: int = 4, seed: int = 0, bias_diffs: bool = False) -> Path:
    """LoRA pairs for every 2-D weight of ``model_file``: all linears of the blocks and outside them; with
    ``bias_diffs``, a ``diff_b`` for each of their biases too (as LoRAs that train biases carry)."""
    with safe_open(str(model_file), framework="pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    return _save_lora(shapes, "diffusion_model.", path, rank, seed, bias_diffs)


def make_text_encoder_lora(clip, path: Path, rank: int = 4, seed: int = 0) -> Path:
    """LoRA pairs for every 2-D weight of a CLIP's text encoders (``text_encoders.<key>``: ComfyUI's generic key
    format for them, which LoraLoader's clip strength applies), the embeddings' too."""
    shapes = {key: list(tensor.shape) for key, tensor in clip.cond_stage_model.state_dict().items()}
    return _save_lora(shapes, "text_encoders.", path, rank, seed)


def _save_lora(shapes: dict[str, list[int]], prefix: str, path: Path, rank: int, seed: int,
               bias_diffs: bool = False) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in shapes.items():
        if not key.endswith(".weight") or len(shape) != 2:
            continue
        stem = prefix + key.removesuffix(".weight")
        out_features, in_features = shape
        tensors[f"{stem}.lora_up.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
        tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
        if bias_diffs and key.removesuffix(".weight") + ".bias" in shapes:
            tensors[f"{stem}.diff_b"] = torch.randn(out_features, generator=generator) * 0.1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
