"""Running ComfyUI's nodes in this process, the way its executor does: :func:`run_node` for one node,
:func:`run_txt2img` for a sampler and decoder as in a prompt, and Qwen-shaped test conditionings.

Each call boots ComfyUI in this process first (:func:`comfy_boot.boot_comfyui_in_process`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from testbed.comfy_boot import boot_comfyui_in_process, run_maybe_async


@dataclass(frozen=True)
class NodeResult:
    """What a node returned: its outputs in order and its UI dict (``None`` when it has none)."""

    outputs: tuple
    ui: dict | None = None


def run_node(class_type: str, **inputs: Any) -> NodeResult:
    """Call a registered node the way ComfyUI's executor does, for V1 and V3 nodes alike.

    V3 nodes (``comfy_api`` ``io.ComfyNode``) run on a locked class clone with empty hidden inputs,
    as in ``execution._async_map_node_over_list``; V1 nodes on a fresh instance. Call it inside
    ``torch.inference_mode()`` to match a real prompt.
    """
    nodes = boot_comfyui_in_process()
    from comfy_api.internal import _ComfyNodeInternal, make_locked_method_func

    node_class = nodes.NODE_CLASS_MAPPINGS[class_type]
    if issubclass(node_class, _ComfyNodeInternal):
        node_class.VALIDATE_CLASS()
        function = make_locked_method_func(node_class, node_class.FUNCTION, node_class.PREPARE_CLASS_CLONE({}))
    else:
        function = getattr(node_class(), node_class.FUNCTION)
    returned = run_maybe_async(function(**inputs))

    if isinstance(returned, dict):
        return NodeResult(tuple(returned.get("result", ())), returned.get("ui"))
    if isinstance(returned, tuple):
        return NodeResult(returned)
    ui = returned.ui.as_dict() if hasattr(returned.ui, "as_dict") else returned.ui
    return NodeResult(tuple(returned.args), ui)


def node_output(class_type: str, **inputs: Any) -> Any:
    """A node's first output, run as a prompt runs it: under inference mode (ComfyUI's quantized layers make their
    Parameters anew when the model moves, which needs the mode they were made in)."""
    with torch.inference_mode():
        return run_node(class_type, **inputs).outputs[0]


def make_test_conditioning(seed: int = 0, tokens: int = 8, joint_dim: int = 64) -> list:
    """A Qwen-shaped CONDITIONING: ``[[cond [1, tokens, joint_dim], {"pooled_output": None}]]``.

    That is what ComfyUI's Qwen-Image text encoder yields when no token is masked (its attention
    mask is then dropped and it has no pooled output).
    """
    generator = torch.Generator().manual_seed(seed)
    cond = torch.randn((1, tokens, joint_dim), generator=generator)
    return [[cond, {"pooled_output": None}]]


def qwen_joint_dim(model: Any) -> int:
    """The text width a Qwen-Image MODEL (a ComfyUI ModelPatcher) expects."""
    return model.model.diffusion_model.txt_norm.weight.shape[0]


@dataclass(frozen=True)
class Txt2ImgResult:
    """KSampler's latent (``samples["samples"]``) and VAEDecode's IMAGE ``[B, H, W, C]`` (or ``None``)."""

    latent: torch.Tensor
    image: torch.Tensor | None


def run_txt2img(model: Any, vae: Any = None, seed: int = 0, steps: int = 2, *, cfg: float = 4.0,
                width: int = 64, height: int = 64, sampler_name: str = "euler", scheduler: str = "simple",
                positive: list | None = None, negative: list | None = None) -> Txt2ImgResult:
    """EmptySD3LatentImage -> KSampler -> VAEDecode (when ``vae`` is given), in-process, like a prompt.

    ``model`` is any MODEL (e.g. an offloaded clone). Without conditionings, seeded test ones of the
    model's text width are used (positive seed 1, negative seed 2, same token count so ComfyUI
    batches cond and uncond).
    """
    joint_dim = qwen_joint_dim(model)
    positive = positive if positive is not None else make_test_conditioning(1, joint_dim=joint_dim)
    negative = negative if negative is not None else make_test_conditioning(2, joint_dim=joint_dim)
    with torch.inference_mode():
        (latent,) = run_node("EmptySD3LatentImage", width=width, height=height, batch_size=1).outputs
        (samples,) = run_node("KSampler", model=model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                              scheduler=scheduler, positive=positive, negative=negative,
                              latent_image=latent, denoise=1.0).outputs
        image = run_node("VAEDecode", vae=vae, samples=samples).outputs[0] if vae is not None else None
    return Txt2ImgResult(latent=samples["samples"], image=image)
