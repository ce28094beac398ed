"""A random LoRA for a fixture diffusion model, in ComfyUI's generic key format."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def make_lora(model_file: Path, path: Path, rank: int = 4, seed: int = 0, bias_diffs: bool = False) -> Path:
    """LoRA pairs for every 2-D weight of ``model_file``: all linears of the blocks and outside them; with
    ``bias_diffs``, a ``diff_b`` for each of their biases too (as LoRAs that train biases carry)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(model_file), framework="pt") as f:
        keys = f.keys()
        for key in keys:
            shape = f.get_slice(key).get_shape()
            if not key.endswith(".weight") or len(shape) != 2:
                continue
            stem = "diffusion_model." + key.removesuffix(".weight")
            out_features, in_features = shape
            tensors[f"{stem}.lora_up.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
            tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
            if bias_diffs and key.removesuffix(".weight") + ".bias" in keys:
                tensors[f"{stem}.diff_b"] = torch.randn(out_features, generator=generator) * 0.1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
