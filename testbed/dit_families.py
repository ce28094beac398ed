"""Tiny models of every diffusion-transformer family ComfyUI supports (``MODELS``), built by ComfyUI itself from its
own configs with seeded weights, and saved as files in ComfyUI's keys."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from testbed.other_models import save_with_detection


def noise(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def text(tokens: int = 5, width: int = 32) -> torch.Tensor:
    return noise(1, tokens, width, seed=1)


@dataclass(frozen=True)
class TinyModel:
    """A ``comfy.supported_models`` config with a tiny ``unet_config``, and what ``apply_model`` takes."""

    config: str
    unet_config: dict
    latent: tuple[int, ...]
    conds: Callable[[], dict] = field(default=lambda: {"c_crossattn": text()})
    params: str = ""  # the dataclass of the constructor's arguments, where newer ComfyUI added required ones
    newer_fields: dict = field(default_factory=dict)  # those fields, given only where ``params`` has them
    outside: Callable[[], dict] = dict  # checkpoint tensors beside the diffusion model that ``get_model`` reads

    def full_config(self) -> dict:
        config = {**self.unet_config, "dtype": torch.float32}
        if self.params:
            module, _, name = self.params.rpartition(".")
            declared = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
            config.update({k: v for k, v in self.newer_fields.items() if k in declared})
        return config

    def saved_config(self) -> dict:
        """The config ComfyUI is to detect from the model's file (loading sets the dtype)."""
        return {key: value for key, value in self.full_config().items() if key != "dtype"}


def seconds_conditioners(*names: str, **kwargs) -> Callable[[], dict]:
    """The weights of Stable Audio's seconds conditioners, which its ``get_model`` reads from the checkpoint."""
    def weights() -> dict:
        from comfy.ldm.audio.embedders import NumberConditioner

        torch.manual_seed(0)
        return {f"conditioner.conditioners.{name}.{key}": tensor for name in names
                for key, tensor in NumberConditioner(768, **kwargs).state_dict().items()}
    return weights


FLUX_LIKE = dict(hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=3, axes_dim=[8, 12, 12])
WAN = dict(image_model="wan2.1", model_type="t2v", dim=64, ffn_dim=128, num_heads=2, num_layers=3, text_dim=32,
           freq_dim=256, patch_size=(1, 2, 2), window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


MODELS = {
    "flux": TinyModel("Flux", dict(
        image_model="flux", in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, theta=10000, patch_size=2,
        qkv_bias=True, guidance_embed=True, **FLUX_LIKE),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "y": noise(1, 16, seed=2), "guidance": torch.tensor([3.5])},
        "comfy.ldm.flux.model.FluxParams", {"txt_ids_dims": []}),
    "longcat_image": TinyModel("LongCatImage", dict(
        image_model="flux", in_channels=4, out_channels=4, vec_in_dim=None, context_in_dim=32, theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=False, **FLUX_LIKE),
        (1, 4, 8, 8), lambda: {"c_crossattn": text()}, "comfy.ldm.flux.model.FluxParams", {"txt_ids_dims": [1, 2]}),
    "flux2": TinyModel("Flux2", dict(
        image_model="flux2", in_channels=8, out_channels=8, vec_in_dim=None, context_in_dim=32, theta=2000,
        patch_size=1, qkv_bias=False, guidance_embed=True, global_modulation=True, mlp_silu_act=True, ops_bias=False,
        default_ref_method="index", ref_index_scale=10.0, **{**FLUX_LIKE, "axes_dim": [8, 8, 8, 8]}),
        (1, 8, 8, 8), lambda: {"c_crossattn": text(), "guidance": torch.tensor([3.5])},
        "comfy.ldm.flux.model.FluxParams", {"txt_ids_dims": [3]}),
    "chroma": TinyModel("Chroma", dict(
        image_model="chroma", in_channels=16, out_channels=16, context_in_dim=32, theta=10000, patch_size=2,
        qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=32, n_layers=2, **FLUX_LIKE),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "guidance": torch.tensor([0.0])},
        "comfy.ldm.chroma.model.ChromaParams", {"txt_ids_dims": [], "vec_in_dim": None}),
    "hunyuan_video": TinyModel("HunyuanVideo", dict(
        image_model="hunyuan_video", in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, theta=256,
        patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None, **FLUX_LIKE),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "y": noise(1, 16, seed=2), "guidance": torch.tensor([6.0])},
        "comfy.ldm.hunyuan_video.model.HunyuanVideoParams", {"meanflow_sum": False}),
    "chroma_radiance": TinyModel("ChromaRadiance", dict(
        image_model="chroma_radiance", in_channels=3, out_channels=3, context_in_dim=32, theta=10000, patch_size=16,
        qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=32, n_layers=2, nerf_hidden_size=16, nerf_mlp_ratio=2,
        nerf_depth=2, nerf_max_freqs=4, nerf_tile_size=64, nerf_final_head_type="linear",
        nerf_embedder_dtype=torch.float32, **FLUX_LIKE),
        (1, 3, 32, 32), lambda: {"c_crossattn": text(), "guidance": torch.tensor([0.0])},
        "comfy.ldm.chroma_radiance.model.ChromaRadianceParams",
        {"txt_ids_dims": [], "vec_in_dim": None, "use_x0": False, "use_sequential_txt_ids": False}),
    "hunyuan_video15": TinyModel("HunyuanVideo15", dict(
        image_model="hunyuan_video", in_channels=4, out_channels=4, vec_in_dim=None, context_in_dim=32, theta=256,
        patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
        use_cond_type_embedding=True, vision_in_dim=24, **FLUX_LIKE),
        (1, 4, 2, 4, 4), lambda: {"c_crossattn": text()},
        "comfy.ldm.hunyuan_video.model.HunyuanVideoParams", {"meanflow_sum": False}),
    "wan21": TinyModel("WAN21_T2V", dict(WAN, in_dim=4, out_dim=4), (1, 4, 2, 8, 8)),
    "wan22_5b": TinyModel("WAN22_T2V", dict(WAN, in_dim=48, out_dim=48), (1, 48, 2, 8, 8)),
    "wan22_camera": TinyModel("WAN22_Camera", dict(WAN, model_type="camera_2.2", num_layers=8, in_dim=4, out_dim=4,
                                                   in_dim_control_adapter=6),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "camera_conditions": noise(1, 6, 2, 64, 64, seed=4)}),
    "wan21_vace": TinyModel("WAN21_Vace", dict(WAN, model_type="vace", num_layers=4, in_dim=4, out_dim=4,
                                               vace_layers=2, vace_in_dim=12),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "vace_context": noise(1, 1, 12, 2, 8, 8, seed=2),
                                  "vace_strength": [1.0]}),
    "kandinsky5": TinyModel("Kandinsky5", dict(
        image_model="kandinsky5", in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32,
        model_dim=64, ff_dim=128, visual_embed_dim=36, patch_size=(1, 2, 2), num_text_blocks=2, num_visual_blocks=3,
        axes_dims=(8, 12, 12)),
        (1, 4, 1, 8, 8), lambda: {"c_crossattn": text(), "y": noise(1, 16, seed=2),
                                  "c_concat": noise(1, 5, 1, 8, 8, seed=3)}),
    "wan21_i2v": TinyModel("WAN21_I2V", dict(WAN, model_type="i2v", dim=256, ffn_dim=512, num_layers=4, in_dim=9, out_dim=4),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 5, 2, 8, 8, seed=2),
                                  "clip_fea": noise(1, 9, 1280, seed=3)}),
    "wan22_s2v": TinyModel("WAN22_S2V", dict(
        WAN, model_type="s2v", dim=256, ffn_dim=1024, num_layers=4, in_dim=16, out_dim=16, audio_dim=32,
        num_audio_token=4, enable_adain=True, cond_dim=16, audio_inject_layers=[0, 2], adain_mode="attn_norm",
        framepack_drop_mode="padd"),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "audio_embed": noise(1, 25, 32, 8, seed=2),
                                   "reference_latent": noise(1, 16, 1, 8, 8, seed=3),
                                   "reference_motion": noise(1, 16, 3, 8, 8, seed=4),
                                   "control_video": noise(1, 16, 2, 8, 8, seed=5)}),
    "wan22_animate": TinyModel("WAN22_Animate", dict(  # the face motion encoder (35M weights) is fixed in size
        WAN, model_type="animate", dim=768, ffn_dim=3072, num_heads=6, num_layers=5, in_dim=36, out_dim=16,
        motion_encoder_dim=512),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 20, 2, 8, 8, seed=2),
                                   "clip_fea": noise(1, 9, 1280, seed=3), "pose_latents": noise(1, 16, 1, 8, 8, seed=4),
                                   "face_pixel_values": noise(1, 3, 1, 512, 512, seed=5)}),
    "wan21_humo": TinyModel("WAN21_HuMo", dict(  # the audio projection (39M weights) is fixed in size
        WAN, model_type="humo", dim=512, ffn_dim=8192, num_heads=4, num_layers=4, in_dim=16, out_dim=16),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "audio_embed": noise(1, 2, 8, 5, 1280, seed=2),
                                   "reference_latent": noise(1, 16, 1, 8, 8, seed=3)}),
    "wan21_scail": TinyModel("WAN21_SCAIL", dict(
        WAN, model_type="scail", dim=256, ffn_dim=512, num_layers=4, in_dim=20, out_dim=16),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 4, 2, 8, 8, seed=2),
                                   "clip_fea": noise(1, 9, 1280, seed=3), "pose_latents": noise(1, 20, 2, 4, 4, seed=4),
                                   "reference_latent": noise(1, 20, 1, 8, 8, seed=5)}),
    "wan21_scail2": TinyModel("WAN21_SCAIL2", dict(  # SCAIL with a mask stream added to both inputs
        WAN, model_type="scail2", dim=256, ffn_dim=512, num_layers=4, in_dim=20, out_dim=16),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 4, 2, 8, 8, seed=2),
                                   "clip_fea": noise(1, 9, 1280, seed=3), "pose_latents": noise(1, 20, 2, 4, 4, seed=4),
                                   "reference_latent": noise(1, 20, 1, 8, 8, seed=5),
                                   "ref_mask_latents": noise(1, 28, 3, 8, 8, seed=6),
                                   "sam_latents": noise(1, 28, 2, 4, 4, seed=7)}),
    "wan22_wandancer": TinyModel("WAN22_WanDancer", dict(
        WAN, model_type="wandancer", dim=256, ffn_dim=1024, num_layers=6, in_dim=36, out_dim=16,
        audio_inject_layers=[0, 3], music_dim=32, music_heads=2, music_feature_dim=35, music_latent_dim=32),
        (1, 16, 2, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 20, 2, 8, 8, seed=2),
                                   "clip_fea": noise(1, 9, 1280, seed=3), "clip_fea_ref": noise(1, 9, 1280, seed=4),
                                   "audio_embed": noise(1, 20, 35, seed=5)}),
    "wan21_causal_ar": TinyModel("WAN21_CausalAR_T2V", dict(WAN, causal_ar=True, in_dim=4, out_dim=4),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "transformer_options": {"ar_state": {  # the KV-cache path
            "start_frame": 0, "crossattn_caches": [{"is_init": False} for _ in range(3)],
            "kv_caches": [{"k": torch.zeros(1, 32, 2, 32), "v": torch.zeros(1, 32, 2, 32), "end": 0}
                          for _ in range(3)]}}}),
    "wan_animate2": TinyModel("WAN_Animate2", dict(  # runs its blocks through forward_pose and forward_gen
        WAN, model_type="animate2", dim=256, ffn_dim=512, num_layers=4, in_dim=36, out_dim=16),
        (1, 16, 3, 8, 8), lambda: {"c_crossattn": text(), "c_concat": noise(1, 20, 3, 8, 8, seed=2),
                                   "clip_fea": noise(1, 9, 1280, seed=3), "pose_latents": noise(1, 16, 2, 8, 8, seed=4)}),
    "joy_image": TinyModel("JoyImage", dict(
        image_model="joyimage", patch_size=[1, 2, 2], in_channels=4, hidden_size=128, num_attention_heads=1,
        text_dim=32, mlp_width_ratio=2.0, num_layers=3),  # rope_dim_list [16, 56, 56] is fixed: heads of 128
        (1, 4, 1, 8, 8), lambda: {"c_crossattn": text(), "ref_latents": [noise(1, 4, 1, 8, 8, seed=2)]}),
    "ace_step15": TinyModel("ACEStep15", dict(  # six RoPE caches of 32768 positions (25 MB at heads of 16) are fixed
        audio_model="ace1.5", in_channels=192, hidden_size=256, text_hidden_dim=32, timbre_hidden_dim=64,
        audio_acoustic_hidden_dim=64, num_dit_layers=4, num_lyric_layers=1, num_timbre_layers=1,
        num_tokenizer_layers=1, num_heads=16, num_kv_heads=1, head_dim=16, intermediate_size=4096, patch_size=2,
        pool_window_size=5, fsq_dim=64, encoder_hidden_size=64, encoder_intermediate_size=128, encoder_num_heads=4),
        (1, 64, 10), lambda: {"c_crossattn": text(), "lyric_embed": noise(1, 6, 32, seed=2),
                              "refer_audio": noise(1, 64, 10, seed=3), "is_covers": False}),
    "ernie_image": TinyModel("ErnieImage", dict(
        image_model="ernie", hidden_size=64, num_attention_heads=2, num_layers=3, ffn_hidden_size=128, in_channels=8,
        out_channels=8, patch_size=1, text_in_dim=32, rope_axes_dim=(8, 12, 12)), (1, 8, 4, 4)),
    "krea2": TinyModel("Krea2", dict(
        image_model="krea2", features=64, tdim=32, txtdim=32, heads=2, kvheads=2, multiplier=2, layers=3, patch=2,
        channels=4, txtlayers=2, txtheads=2, txtkvheads=2),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(width=64)}),  # two text-encoder layers of 32
    "lens": TinyModel("Lens", dict(
        image_model="lens", patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=32,
        num_attention_heads=2, enc_hidden_dim=32, axes_dims_rope=(4, 14, 14), multi_layer_encoder_feature=False),
        (1, 16, 4, 4)),
    "cogvideox": TinyModel("CogVideoX_T2V", dict(
        image_model="cogvideox", num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        time_embed_dim=32, text_embed_dim=32, num_layers=3, sample_width=8, sample_height=8, sample_frames=5,
        patch_size=2, max_text_seq_length=5, use_rotary_positional_embeddings=True), (1, 4, 2, 8, 8)),
    "boogu": TinyModel("Boogu", dict(
        image_model="boogu", patch_size=2, in_channels=4, hidden_size=64, num_layers=3, num_double_stream_layers=2,
        num_refiner_layers=2, num_attention_heads=2, num_kv_heads=2, multiple_of=16, ffn_dim_multiplier=2.0,
        axes_dim_rope=(8, 12, 12), axes_lens=(64, 64, 64), instruction_feat_dim=32),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "num_tokens": 5}),
    "pixeldit": TinyModel("PixelDiTT2I", dict(
        image_model="pixeldit_t2i", in_channels=3, num_groups=2, hidden_size=64, pixel_hidden_size=8,
        pixel_attn_hidden_size=32, pixel_num_groups=2, patch_depth=3, pixel_depth=1, patch_size=4, txt_embed_dim=32,
        txt_max_length=5), (1, 3, 16, 16)),
    "mage_flow": TinyModel("MageFlow", dict(
        image_model="mage_flow", in_channels=16, out_channels=16, num_layers=3, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 14, 14)), (1, 16, 4, 4)),
    "sd3": TinyModel("SD3", dict(
        in_channels=4, out_channels=4, patch_size=2, depth=3, input_size=None, adm_in_channels=32,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 192}},
        num_patches=64, pos_embed_max_size=8, pos_embed_scaling_factor=None, x_block_self_attn_layers=[]),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "y": noise(1, 32, seed=2)}),
    "auraflow": TinyModel("AuraFlow", dict(
        in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=5, n_double_layers=2, n_heads=2,
        global_conddim=64, cond_seq_dim=32, max_seq=64), (1, 4, 8, 8)),
    "lumina2": TinyModel("Lumina2", dict(
        image_model="lumina2", patch_size=2, in_channels=4, dim=64, n_layers=3, n_refiner_layers=2, n_heads=2,
        n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=2.0, qk_norm=True, cap_feat_dim=32, axes_dims=[8, 12, 12],
        axes_lens=[64, 64, 64]),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "num_tokens": 5}),
    "omnigen2": TinyModel("Omnigen2", dict(
        image_model="omnigen2", patch_size=2, in_channels=4, hidden_size=64, num_layers=3, num_refiner_layers=2,
        num_attention_heads=2, num_kv_heads=2, multiple_of=16, ffn_dim_multiplier=2.0, axes_dim_rope=(8, 12, 12),
        axes_lens=(64, 64, 64), text_feat_dim=32),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "num_tokens": 5}),
    "hunyuan3d2": TinyModel("Hunyuan3Dv2", dict(
        image_model="hunyuan3d2", in_channels=8, context_in_dim=32, hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=2,
        depth_single_blocks=3, guidance_embed=False), (1, 8, 16)),
    "hunyuan3d2_1": TinyModel("Hunyuan3Dv2_1", dict(  # skip connections in the second half, MoE in the last layers
        image_model="hunyuan3d2_1", in_channels=8, hidden_size=64, context_dim=32, depth=4, num_heads=2,
        num_moe_layers=1, num_experts=2, moe_top_k=1, guidance_cond_proj_dim=None),
        (2, 8, 16), lambda: {"c_crossattn": noise(2, 5, 32, seed=1)}),  # cond and uncond: 0.3.75 needs both
    "z_image": TinyModel("ZImage", dict(
        image_model="lumina2", patch_size=2, in_channels=4, dim=256, n_layers=3, n_refiner_layers=2, n_heads=2,
        n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=8.0 / 3.0, qk_norm=True, cap_feat_dim=32,
        axes_dims=[32, 48, 48], axes_lens=[64, 64, 64], z_image_modulation=True, time_scale=1000.0,
        pad_tokens_multiple=4),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "num_tokens": 5}),
    "z_image_pixel": TinyModel("ZImagePixelSpace", dict(  # Z-Image's layers, an MLP decoder of res_blocks on pixels
        image_model="zimage_pixel", patch_size=2, in_channels=3, dim=256, n_layers=3, n_refiner_layers=2, n_heads=2,
        n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=8.0 / 3.0, qk_norm=True, cap_feat_dim=32,
        axes_dims=[32, 48, 48], axes_lens=[64, 64, 64], z_image_modulation=True, time_scale=1000.0,
        pad_tokens_multiple=4, decoder_hidden_size=32, decoder_num_res_blocks=2, decoder_max_freqs=4),
        (1, 3, 16, 16), lambda: {"c_crossattn": text(), "num_tokens": 5}),
    "stable_audio": TinyModel("StableAudio", dict(
        audio_model="dit1.0", io_channels=8, embed_dim=64, cond_token_dim=32, global_cond_dim=64, depth=3, num_heads=2),
        (1, 8, 16), lambda: {"c_crossattn": text(), "global_embed": noise(1, 64, seed=2)},
        outside=seconds_conditioners("seconds_start", "seconds_total")),
    "stable_audio3": TinyModel("StableAudio3", dict(  # the global condition embedded once, shared by the layers
        audio_model="dit1.0", io_channels=8, embed_dim=64, cond_token_dim=32, global_cond_dim=64, depth=3, num_heads=2,
        global_cond_shared_embed=True, global_cond_type="adaLN", timestep_features_type="expo"),
        (1, 8, 16), lambda: {"c_crossattn": text(), "global_embed": noise(1, 64, seed=2)},
        outside=seconds_conditioners("seconds_total", fourier_features_type="expo")),
    "qwen_image": TinyModel("QwenImage", dict(
        image_model="qwen_image", in_channels=64, out_channels=16, num_layers=3, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 14, 14)), (1, 16, 1, 8, 8)),
    "hidream": TinyModel("HiDream", dict(
        image_model="hidream", patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=3,
        attention_head_dim=32, num_attention_heads=2, caption_channels=[32, 24], text_emb_dim=16,
        num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[16, 8, 8], max_resolution=[16, 16],
        llama_layers=[0, 1, 1, 1, 1]),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "y": noise(1, 16, seed=2),
                               "encoder_hidden_states_llama3": noise(1, 2, 5, 24, seed=3)}),
    "cosmos1": TinyModel("CosmosT2V", dict(  # its blocks are a ModuleDict
        image_model="cosmos", max_img_h=64, max_img_w=64, max_frames=8, in_channels=4, out_channels=4,
        patch_spatial=2, patch_temporal=1, model_channels=64, block_config="FA-CA-MLP", concat_padding_mask=True,
        pos_emb_cls="rope3d", pos_emb_learnable=False, pos_emb_interpolation="crop", block_x_format="THWBD",
        affline_emb_norm=True, use_adaln_lora=True, adaln_lora_dim=16, num_blocks=3, num_heads=2,
        crossattn_emb_channels=32, extra_per_block_abs_pos_emb=True, rope_h_extrapolation_ratio=1.0,
        rope_w_extrapolation_ratio=1.0, rope_t_extrapolation_ratio=2.0, extra_per_block_abs_pos_emb_type="learnable"),
        (1, 4, 2, 8, 8)),
    "cosmos_predict2": TinyModel("CosmosT2IPredict2", dict(
        image_model="cosmos_predict2", max_img_h=64, max_img_w=64, max_frames=8, in_channels=4, out_channels=4,
        patch_spatial=2, patch_temporal=1, concat_padding_mask=True, model_channels=64, num_blocks=3, num_heads=2,
        crossattn_emb_channels=32, pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop",
        use_adaln_lora=True, adaln_lora_dim=16, extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0,
        rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0), (1, 4, 1, 8, 8)),
    "ltxv": TinyModel("LTXV", dict(
        image_model="ltxv", in_channels=8, cross_attention_dim=64, attention_head_dim=32, num_attention_heads=2,
        caption_channels=32, num_layers=3),
        (1, 8, 2, 4, 4), lambda: {"c_crossattn": text(), "attention_mask": torch.ones(1, 5)}),
    "ltxav": TinyModel("LTXAV", dict(
        image_model="ltxav", in_channels=8, audio_in_channels=128, cross_attention_dim=64,
        audio_cross_attention_dim=32, attention_head_dim=32, audio_attention_head_dim=16, num_attention_heads=2,
        audio_num_attention_heads=2, caption_channels=32, num_layers=3, connector_attention_head_dim=16,
        connector_num_attention_heads=2, connector_num_layers=1),
        # video (1, 8, 2, 4, 4) and audio (1, 8, 3, 16), packed as the sampler packs them; their captions side by side
        (1, 1, 8 * 2 * 4 * 4 + 8 * 3 * 16),
        lambda: {"c_crossattn": text(width=64), "attention_mask": torch.ones(1, 5),
                 "latent_shapes": [torch.Size((1, 8, 2, 4, 4)), torch.Size((1, 8, 3, 16))]}),
    "mochi": TinyModel("GenmoMochi", dict(  # each block's MLP is 12288 wide (hidden_size_x * mlp_ratio_x, asserted)
        image_model="mochi_preview", depth=3, patch_size=2, num_heads=2, hidden_size_x=32, hidden_size_y=32,
        mlp_ratio_x=384.0, mlp_ratio_y=2.0, learn_sigma=False, in_channels=4, qk_norm=True, qkv_bias=False,
        out_bias=True, attn_drop=0.0, patch_embed_bias=True, posenc_preserve_area=True, timestep_mlp_bias=True,
        attend_to_padding=False, timestep_scale=1000.0, use_t5=True, t5_feat_dim=32, t5_token_length=5,
        rope_theta=10000.0),
        (1, 4, 2, 8, 8), lambda: {"c_crossattn": text(), "attention_mask": torch.ones(1, 5), "num_tokens": 5}),
    "hidream_o1": TinyModel("HiDreamO1", dict(  # pixel space, 32x32 patches; a vocabulary of 64 (no TMS token)
        image_model="hidream_o1",
        text_config_overrides=dict(vocab_size=64, hidden_size=64, intermediate_size=1024, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_dims=[6, 5, 5]),
        vision_config_overrides=dict(hidden_size=32, num_heads=2, intermediate_size=64, depth=1,
                                     num_position_embeddings=16)),
        (1, 3, 64, 64), lambda: importlib.import_module("comfy.ldm.hidream_o1.conditioning").build_extra_conds(
            torch.tensor([[1, 2, 3, 4, 5]]), noise(1, 3, 64, 64))),
    "seedvr2": TinyModel("SeedVR2", dict(  # an even num_layers (window methods alternate in pairs)
        image_model="seedvr2", vid_dim=128, txt_in_dim=32, heads=2, head_dim=64, num_layers=4, mm_layers=2,
        norm_eps=1e-5, mlp_type="swiglu", rope_dim=48, vid_out_norm=True),
        (1, 16, 1, 8, 8), lambda: {"c_crossattn": text(), "condition": noise(1, 17, 1, 8, 8, seed=2),
                                   "transformer_options": {"cond_or_uncond": [0]}}),
    "minimax_h3": TinyModel("MiniMaxH3", dict(  # rope on 6 * rope_inv_freq_len of each head's 32 dims
        image_model="minimax_h3", hidden_size=64, num_layers=3, token_refiner_num_layers=1, num_attention_heads=2,
        attention_head_dim=32, ffn_hidden_size=128, latents_dim=8, audio_latents_dim=8, text_dim=32,
        time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4),
        (1, 1, 8 * 2 * 4 * 4 + 8 * 2 * 3),  # video (1, 8, 2, 4, 4) and stereo audio (1, 8, 2, 3), packed
        lambda: {"c_crossattn": text(), "latent_shapes": [torch.Size((1, 8, 2, 4, 4)), torch.Size((1, 8, 2, 3))]}),
    "pid": TinyModel("PiD", dict(  # PixelDiT-T2I and an LQ branch: sr_scale * latent_spatial_down_factor = patch_size
        image_model="pid", in_channels=3, num_groups=2, hidden_size=64, pixel_hidden_size=8,
        pixel_attn_hidden_size=32, pixel_num_groups=2, patch_depth=3, pixel_depth=1, patch_size=4, txt_embed_dim=32,
        txt_max_length=5, lq_latent_channels=4, lq_hidden_dim=16, lq_num_res_blocks=1, sr_scale=1,
        latent_spatial_down_factor=4),
        (1, 3, 16, 16), lambda: {"c_crossattn": text(), "lq_latent": noise(1, 4, 4, 4, seed=2),
                                 "degrade_sigma": torch.tensor([0.5])}),
    "triposplat": TinyModel("TripoSplat", dict(  # 16 latent tokens (q_token_length) and a camera token
        image_model="triposplat", q_token_length=16, in_channels=8, out_channels=8, model_channels=64,
        cond_channels=32, cond2_channels=16, num_blocks=3, num_refiner_blocks=1, num_head_channels=32,
        cam_channels=5),
        (1, 1, 16 * 8 + 5), lambda: {"c_crossattn": text(),
                                     "latent_shapes": [torch.Size((1, 16, 8)), torch.Size((1, 1, 5))]}),
    "hunyuan_dit": TinyModel("HunyuanDiT", dict(
        image_model="hydit", input_size=8, patch_size=2, in_channels=4, hidden_size=128, depth=6, num_heads=2,
        mlp_ratio=2.0, text_states_dim=32, text_states_dim_t5=24, text_len=5, text_len_t5=6),
        (1, 4, 8, 8), lambda: {"c_crossattn": text(), "text_embedding_mask": torch.ones(1, 5),
                               "encoder_hidden_states_t5": noise(1, 6, 24, seed=2),
                               "text_embedding_mask_t5": torch.ones(1, 6)}),
    "pixart_sigma": TinyModel("PixArtSigma", dict(
        image_model="pixart_sigma", num_heads=2, patch_size=8, hidden_size=64, in_channels=4, depth=3,
        caption_channels=32, model_max_length=5, micro_condition=False, input_size=16, pe_interpolation=0.25),
        (1, 4, 64, 64)),
}


def comfy_version() -> str:
    import comfyui_version

    return comfyui_version.__version__


def supported_config(name: str) -> type:
    """``comfy.supported_models.<name>``; the test is skipped where this ComfyUI has no such model."""
    import comfy.supported_models

    config_class = getattr(comfy.supported_models, name, None)
    if config_class is None:
        pytest.skip(f"ComfyUI {comfy_version()} has no {name} model")
    return config_class


def build(tiny: TinyModel):
    """ComfyUI's BaseModel for ``tiny`` with seeded weights, in a plain ModelPatcher."""
    import comfy.model_management as mm
    from comfy.model_patcher import ModelPatcher

    model = supported_config(tiny.config)(tiny.full_config()).get_model(tiny.outside())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every tensor a checkpoint holds: ComfyUI's ops leave them uninitialised
        for tensor in model.diffusion_model.state_dict().values():
            if tensor.is_floating_point():
                scale = tensor.shape[1:].numel() ** -0.5 if tensor.dim() > 1 else 0.02
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return ModelPatcher(model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


def save_tiny_file(tiny: TinyModel, path: Path) -> str:
    """``tiny`` with seeded weights, saved in its own keys; ComfyUI detects ``tiny``'s config from it."""
    save_with_detection(build(tiny).model.diffusion_model.state_dict(), tiny.config, tiny.saved_config(), path)
    return path.name


# The tiny Flux and Wan 2.1 T2V with 16 latent channels: what the tiny Wan VAE decodes, as Flux's, Wan 2.2 14B's and
# Qwen-Image's VAEs do, so that a whole workflow runs on them (the live server's stand-ins, the GGUF files).
LATENT_CHANNELS = 16
FLUX = dataclasses.replace(MODELS["flux"], unet_config={**MODELS["flux"].unet_config, "in_channels": LATENT_CHANNELS,
                                                        "out_channels": LATENT_CHANNELS})
WAN_T2V = dataclasses.replace(MODELS["wan21"], unet_config={**MODELS["wan21"].unet_config, "in_dim": LATENT_CHANNELS,
                                                            "out_dim": LATENT_CHANNELS})
