"""The nodes: Group Offload (no copy-back), its loader, Group Offload (text encoder), and the report."""
from __future__ import annotations

from typing import Any

import comfy.sd
import folder_paths
import nodes as comfy_nodes
import torch

from .clip_loader import load_offloaded_clip
from .loader import load_offloaded
from .patcher import GroupOffloadPatcher, make_offloaded
from .settings import GB_INPUT_MAX, GB_INPUT_MIN, HOST_MEMORY_MODES, RESIDENCY_MODES, OffloadSettings
from .telemetry import last_run
from .text_encoder import make_offloaded_clip

OFFLOAD_INPUTS: dict[str, tuple] = {
    "blocks_per_group": ("INT", {
        "default": 1, "min": 1, "max": 64,
        "tooltip": "Consecutive transformer blocks copied to the GPU together. Larger groups mean fewer, "
                   "bigger copies and more GPU memory per streaming buffer."}),
    "prefetch": ("INT", {
        "default": 1, "min": 0, "max": 8,
        "tooltip": "Groups copied ahead on a side stream while the GPU computes. 0 copies each group "
                   "only when it is needed (synchronous); every extra group costs one more buffer."}),
    "residency": (list(RESIDENCY_MODES), {
        "default": "auto",
        "tooltip": "auto: keep as many groups on the GPU as fit beside what the sampling run needs (its "
                   "activations, from the latent's size), stream the rest. stream_all: keep none resident. budget: "
                   "keep resident_gb worth resident. A step that runs out of GPU memory keeps fewer and runs again."}),
    "resident_gb": ("FLOAT", {
        "default": 0.0, "min": GB_INPUT_MIN, "max": GB_INPUT_MAX, "step": 0.5,
        "tooltip": "GPU memory (GB) for groups that stay resident; used only when residency is budget."}),
}
# Optional, so that workflows and API prompts saved before these inputs existed run with their defaults.
HOST_INPUTS: dict[str, tuple] = {
    "host_memory": (list(HOST_MEMORY_MODES), {
        "default": OffloadSettings.host_memory,
        "tooltip": "auto: pack every group into host memory while the RAM available allows it (less a headroom for "
                   "ComfyUI, the text encoder and the OS); the other groups stay where the model's weights are (the "
                   "model file's pages, read through the page cache) and stream from there. budget: at most host_gb "
                   "of packed host copies, shared by all offloaded models."}),
    "host_gb": ("FLOAT", {
        "default": OffloadSettings.host_gb, "min": GB_INPUT_MIN, "max": GB_INPUT_MAX, "step": 0.5,
        "tooltip": "Host memory (GB) for packed copies of the blocks, shared by all offloaded models; used only "
                   "when host_memory is budget. 0 leaves every group in place (file-backed with the Group Offload "
                   "loader)."}),
}
HIDDEN = {"unique_id": "UNIQUE_ID"}


class _OffloadInputsValidation:
    """What ComfyUI's validation of OFFLOAD_INPUTS and HOST_INPUTS misses, checked before anything runs."""

    @classmethod
    def VALIDATE_INPUTS(cls, resident_gb: Any, host_gb: Any = OffloadSettings.host_gb) -> bool | str:
        """ComfyUI's range check lets NaN through (every comparison with NaN is false), and it skips an
        input that the node validates itself; so the settings' own check runs here, on the whole range."""
        given = {name: value for name, value in (("resident_gb", resident_gb), ("host_gb", host_gb))
                 if isinstance(value, (int, float))}  # a linked one: OffloadSettings checks it when the node runs
        try:
            OffloadSettings(**given).validate()
        except ValueError as error:
            return str(error)
        return True


def _input_types(first: dict[str, tuple]) -> dict[str, dict[str, tuple]]:
    """A node's own inputs ``first``, then OFFLOAD_INPUTS (required), HOST_INPUTS (optional) and the node id."""
    return {"required": {**first, **OFFLOAD_INPUTS}, "optional": dict(HOST_INPUTS), "hidden": HIDDEN}


def _settings(unique_id: str | None, **inputs: Any) -> OffloadSettings:
    """The node's OFFLOAD_INPUTS and HOST_INPUTS (the defaults for those an older prompt lacks), and the node
    whose readout shows the telemetry."""
    return OffloadSettings(**inputs, node_id=None if unique_id is None else str(unique_id))


class GroupOffload(_OffloadInputsValidation):
    TITLE = "Group Offload (no copy-back)"
    CATEGORY = "advanced/model"
    DESCRIPTION = ("Keeps the diffusion model's transformer blocks in host memory (pinned, for the groups that stream) "
                   "and copies each group to the GPU just before it runs, never copying weights back. Connect it before "
                   "an unchanged KSampler.")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model, with its blocks offloaded.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return _input_types({"model": ("MODEL", {"tooltip": "The diffusion model to offload."})})

    def apply(self, model, unique_id=None, **inputs):
        return (make_offloaded(model, _settings(unique_id, **inputs)),)


class GroupOffloadTextEncoder(_OffloadInputsValidation):
    TITLE = "Group Offload (text encoder)"
    CATEGORY = "advanced/conditioning"
    DESCRIPTION = ("Keeps the text encoder's transformer layers in host memory (pinned, for the groups that stream) "
                   "and copies each group to the GPU just before it runs, never copying weights back, as Group "
                   "Offload (no copy-back) does for the diffusion model. Connect it before the text encode nodes; "
                   "the conditioning is the one ComfyUI makes.")
    RETURN_TYPES = ("CLIP",)
    OUTPUT_TOOLTIPS = ("The same CLIP, with its text encoder's layers offloaded.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return _input_types({"clip": ("CLIP", {"tooltip": "The text encoder (CLIP) to offload."})})

    def apply(self, clip, unique_id=None, **inputs):
        return (make_offloaded_clip(clip, _settings(unique_id, **inputs)),)


class GroupOffloadLoader(_OffloadInputsValidation):
    TITLE = "Load Diffusion Model (Group Offload)"
    CATEGORY = "advanced/loaders"
    DESCRIPTION = ("Load Diffusion Model, with the transformer blocks read from the file straight into packed host "
                   "copies (pinned, for the groups that stream): the full model never lands on the GPU and host memory "
                   "holds it only once.")
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The diffusion model, with its blocks offloaded.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        weight_dtype = comfy_nodes.UNETLoader.INPUT_TYPES()["required"]["weight_dtype"]
        return _input_types({
            "unet_name": (folder_paths.get_filename_list("diffusion_models"),
                          {"tooltip": "The diffusion model file (models/diffusion_models)."}),
            "weight_dtype": (weight_dtype[0], {**(weight_dtype[1] if len(weight_dtype) > 1 else {}),
                             "tooltip": "Weight format in memory; fp8 halves the bytes each copy moves."}),
        })

    def load(self, unet_name, weight_dtype, unique_id=None, **inputs):
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return (load_offloaded(path, _unet_model_options(weight_dtype), _settings(unique_id, **inputs)),)


class GroupOffloadCLIPLoader(_OffloadInputsValidation):
    TITLE = "Load CLIP (Group Offload)"
    CATEGORY = "advanced/loaders"
    DESCRIPTION = ("Load CLIP, with the text encoder's transformer layers read from the file straight into packed host "
                   "copies (pinned, for the groups that stream), as far as the host memory allows; the other layers "
                   "stream from the file's pages. The text encoder never lands on the GPU whole.")
    RETURN_TYPES = ("CLIP",)
    OUTPUT_TOOLTIPS = ("The text encoder, with its layers offloaded.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        clip_type = comfy_nodes.CLIPLoader.INPUT_TYPES()["required"]["type"]
        return _input_types({
            "clip_name": (folder_paths.get_filename_list("text_encoders"),
                          {"tooltip": "The text encoder file (models/text_encoders), .safetensors."}),
            "type": (clip_type[0], {"tooltip": "The model the text encoder is for, as Load CLIP takes it."}),
        })

    def load(self, clip_name, type, unique_id=None, **inputs):
        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        clip_type = getattr(comfy.sd.CLIPType, type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION)
        return (load_offloaded_clip([path], clip_type, {}, _settings(unique_id, **inputs),
                                    embedding_directory=folder_paths.get_folder_paths("embeddings")),)


# UNETLoader's weight_dtype choices and the model options it derives from each.
_WEIGHT_DTYPE_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn},
    "fp8_e4m3fn_fast": {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
    "fp8_e5m2": {"dtype": torch.float8_e5m2},
}


def _unet_model_options(weight_dtype: str) -> dict[str, Any]:
    if weight_dtype not in _WEIGHT_DTYPE_OPTIONS:
        raise ValueError(f"weight_dtype {weight_dtype!r} is not supported by Load Diffusion Model (Group Offload); "
                         f"choose one of {', '.join(_WEIGHT_DTYPE_OPTIONS)}")
    return dict(_WEIGHT_DTYPE_OPTIONS[weight_dtype])


class GroupOffloadReport:
    TITLE = "Group Offload Report"
    CATEGORY = "advanced/model"
    DESCRIPTION = "Shows what the offloaded model streamed during the last sampling run, and passes the latent on."
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The samples, unchanged.",)
    FUNCTION = "report"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The offloaded model that produced the samples."}),
            "samples": ("LATENT", {"tooltip": "The KSampler output; connecting it makes the report run after sampling."}),
        }}

    def report(self, model, samples):
        if not isinstance(model, GroupOffloadPatcher):
            raise ValueError("Group Offload Report needs a model from Group Offload (no copy-back) or "
                             "Load Diffusion Model (Group Offload)")
        stats = last_run(model.model)
        if stats is None:
            raise ValueError("Group Offload Report: this model has not been sampled yet; connect the samples "
                             "of the KSampler that used it")
        return {"ui": {"group_offload": [stats]}, "result": (samples,)}


NODE_CLASS_MAPPINGS = {cls.__name__: cls for cls in (GroupOffload, GroupOffloadLoader, GroupOffloadTextEncoder,
                                                          GroupOffloadCLIPLoader, GroupOffloadReport)}
NODE_DISPLAY_NAME_MAPPINGS = {name: cls.TITLE for name, cls in NODE_CLASS_MAPPINGS.items()}
