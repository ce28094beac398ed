"""Tiny text encoders that ComfyUI's own loaders (CLIPLoader, DualCLIPLoader, ComfyUI-GGUF's CLIPLoaderGGUF) load
through ComfyUI's own classes: the real layer structure and the real vocabularies (so ComfyUI's tokenizers work),
few layers and tiny widths, a few MB per file (SD3's T5 beside its CLIPs, 4096 wide in fp8: 335 MB).

Each file is the state dict of ComfyUI's own text model (``comfy.text_encoders.t5.T5``, ``comfy.clip_model.
CLIPTextModel``, the ``comfy.text_encoders.llama`` models) built on the meta device from its real config with tiny
widths, in the key layout real files have, seeded (``fixture_models.fill_seeded``) and cached. Files whose
tokenizer lives in the file carry one ComfyUI reads: umt5 ComfyUI's own sentencepiece model (``t5_pile_tokenizer``)
as ``spiece_model``, Mistral 3 (Flux.2) a tiny tekken vocabulary (:func:`tiny_tekken`) as ``tekken_model``.

ComfyUI detects a text encoder from keys and shapes (``comfy.sd.detect_te_model``, some of it by layer index or
real width) and builds it from hard-coded configs; :func:`narrow_text_encoder_configs` (TEST ONLY) makes it detect
and build the tiny files from their weights, through ComfyUI's own ``<model_name>_model_config`` option. Real files
are untouched: the narrowing only sees state dicts narrower than any real text encoder (:data:`TINY_WIDTH_LIMIT`).

API: :func:`text_encoder_file` ``(encoder, ...)``, :data:`ENCODERS` (one file each), :data:`TEXT_ENCODER_FAMILIES`
(a loader, its ``type`` and the files; :meth:`TextEncoderFamily.available` says whether the ComfyUI in use has it),
:func:`use_text_encoders_in_process`, :func:`tiny_tekken` (:func:`comfyui_reads_tekken`: whether ComfyUI can read it),
:func:`text_encoder_gguf_file`. Importing it does not import ComfyUI; the generators do.
"""
from __future__ import annotations

import contextlib
import base64
import contextvars
import functools
import importlib
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from testbed.comfy_boot import boot_comfyui_in_process, comfyui_path, prepare_comfy_import
from testbed.fixture_models import cached_fixture, fill_seeded, link_or_copy, save_safetensors

# Narrower than any real text encoder (T5-small is 512 wide): wider state dicts are ComfyUI's business alone.
TINY_WIDTH_LIMIT = 256
SPIECE_MODEL = "comfy/text_encoders/t5_pile_tokenizer/tokenizer.model"  # a sentencepiece model ComfyUI ships

# Qwen2.5-VL's vision tower (comfy/text_encoders/qwen_vl.py) is built with hard-coded widths; heads of its real 80.
_VISION_HEAD_DIM = 80
_VISION_WIDTHS: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("group_offload_vision_widths",
                                                                               default={})


def _layer_count(state_dict: dict[str, Any], pattern: str) -> int:
    """How many layers have a key ``pattern`` (``{}`` the layer index)."""
    matcher = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
    return len({match.group(1) for key in state_dict if (match := matcher.fullmatch(key))})


def _t5_widths(sd: dict[str, Any]) -> dict[str, int]:
    q = sd["encoder.block.0.layer.0.SelfAttention.q.weight"]
    heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    return {"d_model": q.shape[1], "num_heads": heads, "d_kv": q.shape[0] // heads,
            "d_ff": sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
            "num_layers": _layer_count(sd, "encoder.block.{}.layer.0.SelfAttention.q.weight")}


def _clip_widths(sd: dict[str, Any], head_dim: int) -> dict[str, int]:
    fc1 = sd["text_model.encoder.layers.0.mlp.fc1.weight"]
    return {"hidden_size": fc1.shape[1], "intermediate_size": fc1.shape[0], "num_attention_heads": fc1.shape[1] // head_dim,
            "projection_dim": sd["text_projection.weight"].shape[0],
            "num_hidden_layers": _layer_count(sd, "text_model.encoder.layers.{}.mlp.fc1.weight")}


def _llama_widths(sd: dict[str, Any], head_dim: int) -> dict[str, int]:
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    return {"hidden_size": q.shape[1], "num_attention_heads": q.shape[0] // head_dim,
            "num_key_value_heads": sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
            "intermediate_size": sd["model.layers.0.mlp.gate_proj.weight"].shape[0],
            "num_hidden_layers": _layer_count(sd, "model.layers.{}.self_attn.q_proj.weight")}


def _vision_widths(sd: dict[str, Any]) -> dict[str, int]:
    hidden = sd["visual.patch_embed.proj.weight"].shape[0]
    return {"hidden_size": hidden, "num_heads": hidden // _VISION_HEAD_DIM,
            "intermediate_size": sd["visual.blocks.0.mlp.gate_proj.weight"].shape[0],
            "num_layers": _layer_count(sd, "visual.blocks.{}.norm1.weight")}


@dataclass(frozen=True)
class Encoder:
    """One kind of text-encoder file: how ComfyUI knows and builds the real one, and the tiny widths written.

    ``te_model`` is the ``comfy.sd.TEModel`` ComfyUI detects the real file as; ``model_name`` the name of its
    ``<model_name>_model_config`` option; ``model_class`` ComfyUI's text model, built from ``json_config`` (a file
    of the ComfyUI checkout) or, for the llama models, its config dataclass ``llama_config``. A tiny state dict is
    this encoder's when its embedding (``embedding_key``) has ``vocab_size`` rows and every key of ``requires``, and
    is narrower than any real one: its embedding's width, or where ``narrow_key`` is set, that projection's output
    width (an attention's inner width). Its file is written in ``dtype``.
    """

    te_model: str
    model_name: str
    model_class: str
    embedding_key: str
    vocab_size: int
    tiny: dict[str, int]
    json_config: str | None = None
    llama_config: str | None = None
    head_dim: int = 64  # CLIP: its heads are not in the weights; both real CLIPs have heads of 64
    requires: tuple[str, ...] = ()
    min_layers: int = 1
    vision: dict[str, int] = field(default_factory=dict)
    tokenizer: str | None = None  # the key of the tokenizer the file carries (:data:`_TOKENIZERS`)
    narrow_key: str | None = None  # a projection narrow in its output where the embedding is real-width
    dtype: torch.dtype = torch.bfloat16

    @property
    def architecture(self) -> str:
        return self.model_class.rsplit(".", 2)[-2]  # t5, clip_model, llama

    @property
    def layers_key(self) -> str:
        return {"t5": "num_layers"}.get(self.architecture, "num_hidden_layers")

    def widths(self, sd: dict[str, Any]) -> dict[str, int]:
        """The config entries this encoder's weights determine."""
        if self.architecture == "t5":
            return _t5_widths(sd)
        if self.architecture == "clip_model":
            return _clip_widths(sd, self.head_dim)
        return _llama_widths(sd, getattr(importlib.import_module("comfy.text_encoders.llama"), self.llama_config).head_dim)

    def matches(self, sd: dict[str, Any]) -> bool:
        """Whether ``sd`` is a tiny file of this encoder."""
        embedding = sd.get(self.embedding_key)
        if embedding is None or embedding.shape[0] != self.vocab_size or not all(key in sd for key in self.requires):
            return False
        if self.narrow_key is None:
            return embedding.shape[1] <= TINY_WIDTH_LIMIT
        return self.narrow_key in sd and sd[self.narrow_key].shape[0] <= TINY_WIDTH_LIMIT


# Narrow, with the real vocabularies, yet the layers hold most of the weights, as in every real text encoder (the
# block finder groups the layers only then): their feed-forward widths make up for the embeddings. The trunk
# holds most of a dual or triple CLIP's weights as in the real ones (T5 beside CLIP-L, CLIP-G beside CLIP-L).
_T5_TINY = {"d_model": 64, "num_heads": 2, "d_kv": 32, "d_ff": 49152, "num_layers": 2}
_UMT5_TINY = {**_T5_TINY, "d_ff": 65536}  # (its embedding is eight times T5's)
# SD3's T5 beside CLIP-L and CLIP-G (TripleCLIPLoader): SD3ClipModel pads their output to 4096 before concatenating
# the T5's, so this one is 4096 wide, in fp8 (as t5xxl_fp8_e4m3fn), narrow inside (2 heads of 32). Its layers must
# hold most of the whole CLIP's weights (the block finder's rule): more than its embedding (32128 x 4096, 132 MB)
# and the two CLIPs (57 MB as ComfyUI loads them, fp16) together; 2 x 3 x 4096 x 8192 bytes, 201 MB, do.
_T5_4096_TINY = {**_T5_TINY, "d_model": 4096, "d_ff": 8192}
_CLIP_TINY = {"hidden_size": 64, "intermediate_size": 12288, "num_attention_heads": 1, "projection_dim": 64}
# Heads of the real width (128), fewer of them: 2 query heads over 1 key/value head, as the real ones group.
_LLAMA_TINY = {"hidden_size": 64, "intermediate_size": 40960, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_hidden_layers": 2}

# The tiny files, by name; a state dict is the first encoder here that it matches.
ENCODERS: dict[str, Encoder] = {
    "umt5_xxl": Encoder("T5_XXL", "umt5xxl", "comfy.text_encoders.t5.T5", "shared.weight", 256384, _UMT5_TINY,
                        json_config="comfy/text_encoders/umt5_config_xxl.json", tokenizer="spiece_model"),
    "t5_xxl": Encoder("T5_XXL", "t5xxl", "comfy.text_encoders.t5.T5", "shared.weight", 32128, _T5_TINY,
                      json_config="comfy/text_encoders/t5_config_xxl.json"),
    "t5_xxl_4096": Encoder("T5_XXL", "t5xxl", "comfy.text_encoders.t5.T5", "shared.weight", 32128, _T5_4096_TINY,
                           json_config="comfy/text_encoders/t5_config_xxl.json", dtype=torch.float8_e4m3fn,
                           narrow_key="encoder.block.0.layer.0.SelfAttention.q.weight"),
    # ComfyUI tells CLIP-G by its layer 30 (detection and SDXLClipModel.load_sd), so the tiny one keeps its 32.
    "clip_g": Encoder("CLIP_G", "clip_g", "comfy.clip_model.CLIPTextModel", "text_model.embeddings.token_embedding.weight",
                      49408, {**_CLIP_TINY, "intermediate_size": 4096, "num_hidden_layers": 32},
                      json_config="comfy/clip_config_bigg.json",
                      requires=("text_model.encoder.layers.30.mlp.fc1.weight",), min_layers=31),
    # Two layers at least: ComfyUI tells CLIP-L from T5 by its layer 1 (FluxClipModel.load_sd).
    "clip_l": Encoder("CLIP_L", "clip_l", "comfy.clip_model.CLIPTextModel", "text_model.embeddings.token_embedding.weight",
                      49408, {**_CLIP_TINY, "num_hidden_layers": 3}, json_config="comfy/sd1_clip_config.json",
                      min_layers=2),
    "qwen25_7b": Encoder("QWEN25_7B", "qwen25_7b", "comfy.text_encoders.llama.Qwen25_7BVLI", "model.embed_tokens.weight",
                         152064, _LLAMA_TINY, llama_config="Qwen25_7BVLI_Config",
                         vision={"hidden_size": _VISION_HEAD_DIM, "num_heads": 1, "intermediate_size": 64, "num_layers": 2}),
    # Z-Image takes the next-to-last layer's output: three layers at least.
    "qwen3_4b": Encoder("QWEN3_4B", "qwen3_4b", "comfy.text_encoders.llama.Qwen3_4B", "model.embed_tokens.weight",
                        151936, {**_LLAMA_TINY, "intermediate_size": 32768, "num_hidden_layers": 3},
                        llama_config="Qwen3_4BConfig", min_layers=3),
    # Flux.2 takes layers 10, 20 and 30: 31 layers at least; half as wide as the others, so that its real vocabulary
    # (131072 rows) stays below its layers.
    "mistral3_24b": Encoder("MISTRAL3_24B", "mistral3_24b", "comfy.text_encoders.llama.Mistral3Small24B",
                            "model.embed_tokens.weight", 131072,
                            {**_LLAMA_TINY, "hidden_size": 32, "intermediate_size": 2048, "num_hidden_layers": 31},
                            llama_config="Mistral3Small24BConfig", min_layers=31, tokenizer="tekken_model"),
}


# A tekken file (Mistral's tokenizer, JSON) as ComfyUI's readers take it: the real special tokens' ranks where
# ComfyUI's Flux.2 template and tokenizer use them (the others of the real 1000 are placeholders), the 256 bytes and
# a few merges of them (each of two pieces before it), the real pattern, vocabulary size and version.
_TEKKEN_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 11: "<pad>", 17: "[SYSTEM_PROMPT]",
                   18: "[/SYSTEM_PROMPT]"}
_TEKKEN_MERGES = ("th", "he", "in", "er", "an", "at", "on", "ou", " a", " t", " c", " o", " l", "the", " th", " the",
                  " at", " cat", " of", " on")
_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                   r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
                   r"\s+(?!\S)|\s+")


def tiny_tekken(vocab_size: int = 131072, specials: int = 1000) -> bytes:
    """A tekken vocabulary (JSON) of the 256 bytes and :data:`_TEKKEN_MERGES`, with Mistral's special tokens."""
    pieces = [bytes([b]) for b in range(256)] + [merge.encode() for merge in _TEKKEN_MERGES]
    vocab = [{"rank": rank, "token_bytes": base64.b64encode(piece).decode(), "token_str": piece.decode("latin-1")}
             for rank, piece in enumerate(pieces)]
    special = [{"rank": rank, "token_str": _TEKKEN_SPECIAL.get(rank, f"<SPECIAL_{rank}>"), "is_control": True}
               for rank in range(specials)]
    config = {"pattern": _TEKKEN_PATTERN, "num_vocab_tokens": len(pieces) + specials,
              "default_vocab_size": vocab_size, "default_num_special_tokens": specials, "version": "v7"}
    return json.dumps({"config": config, "vocab": vocab, "special_tokens": special}).encode()


def _spiece_model() -> bytes:
    return (comfyui_path() / SPIECE_MODEL).read_bytes()


# The tokenizers a file can carry, by key.
_TOKENIZERS = {"spiece_model": _spiece_model, "tekken_model": tiny_tekken}


@functools.cache
def comfyui_reads_tekken() -> bool:
    """Whether the ComfyUI in use reads a tekken vocabulary (0.3.75 hands it to transformers' ``MistralConverter``
    through an API that transformers 5 no longer has)."""
    prepare_comfy_import()
    import comfy.text_encoders.flux

    try:
        comfy.text_encoders.flux.load_mistral_tokenizer(tiny_tekken())
    except TypeError:
        return False
    return True


def _identify(sd: dict[str, Any]) -> Encoder | None:
    return next((encoder for encoder in ENCODERS.values() if encoder.matches(sd)), None)


# --------------------------------------------------------------------------------------------
# Test-only narrowing of ComfyUI's text-encoder detection
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _vision_narrowed(widths: dict[str, int]) -> Iterator[None]:
    token = _VISION_WIDTHS.set(widths)
    try:
        yield
    finally:
        _VISION_WIDTHS.reset(token)


def narrow_text_encoder_configs() -> None:
    """TEST ONLY: let ComfyUI load the tiny text encoders of this module.

    Wraps ``comfy.sd.detect_te_model`` (a tiny state dict is detected as its real encoder's ``TEModel``) and
    ``comfy.sd.load_text_encoder_state_dicts`` (a tiny state dict's widths, read from its weights, go into
    ``model_options["<model_name>_model_config"]``, ComfyUI's own override of the text model's config; Qwen2.5-VL's
    vision tower, built with fixed widths, gets its widths during that load through a wrapped
    ``Qwen2VLVisionTransformer.__init__``; ``comfy.sd.t5xxl_detect`` reads a tiny T5's dtype, as ComfyUI reads a real
    one's; ComfyUI's long-CLIP check, ``long_clipl.model_options_long_clip``, which
    replaces a CLIP's option with its own, keeps the widths for a tiny CLIP). State dicts wider than :data:`TINY_WIDTH_LIMIT` are detected and built
    exactly as ComfyUI does. Idempotent; nothing shipped may call it.
    """
    prepare_comfy_import()
    import comfy.sd
    import comfy.text_encoders.long_clipl as long_clipl
    import comfy.text_encoders.qwen_vl as qwen_vl
    import comfy.text_encoders.sd3_clip

    load = comfy.sd.load_text_encoder_state_dicts
    if getattr(load, "group_offload_original", None) is not None:
        return
    detect, signature = comfy.sd.detect_te_model, inspect.signature(load)
    long_clip = long_clipl.model_options_long_clip
    vision_init = qwen_vl.Qwen2VLVisionTransformer.__init__
    t5_detect = comfy.sd.t5xxl_detect

    @functools.wraps(detect)
    def detect_te_model(sd, *args, **kwargs):
        encoder = _identify(sd)
        return detect(sd, *args, **kwargs) if encoder is None else comfy.sd.TEModel[encoder.te_model]

    @functools.wraps(load)
    def load_text_encoder_state_dicts(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tiny = [(encoder, sd) for sd in bound.arguments["state_dicts"] if (encoder := _identify(sd)) is not None]
        if not tiny:
            return load(*args, **kwargs)
        options = dict(bound.arguments["model_options"])
        vision = {}
        for encoder, sd in tiny:
            key = f"{encoder.model_name}_model_config"
            options[key] = {**options.get(key, {}), **encoder.widths(sd)}
            if encoder.vision:
                vision = _vision_widths(sd)
        bound.arguments["model_options"] = options
        with _vision_narrowed(vision):
            return load(*bound.args, **bound.kwargs)

    @functools.wraps(t5_detect)
    def t5xxl_detect(clip_data):
        """ComfyUI reads a T5-XXL's dtype (and quantization) only where it finds block 23."""
        tiny = [sd for sd in clip_data if getattr(_identify(sd), "architecture", None) == "t5"]
        return t5_detect(clip_data) if not tiny else comfy.text_encoders.sd3_clip.t5_xxl_detect(tiny[0])

    @functools.wraps(long_clip)
    def model_options_long_clip(sd, tokenizer_data, model_options):
        tokenizer_data, options = long_clip(sd, tokenizer_data, model_options)
        encoder = _identify(sd)
        if encoder is not None and encoder.architecture == "clip_model":
            key = f"{encoder.model_name}_model_config"
            options = {**options, key: {**model_options.get(key, {}), **options.get(key, {})}}
        return tokenizer_data, options

    @functools.wraps(vision_init)
    def narrowed_vision_init(self, *args, **kwargs):
        vision_init(self, *args, **{**kwargs, **_VISION_WIDTHS.get()})

    load_text_encoder_state_dicts.group_offload_original = load
    comfy.sd.detect_te_model = detect_te_model
    comfy.sd.t5xxl_detect = t5xxl_detect
    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts
    long_clipl.model_options_long_clip = model_options_long_clip
    qwen_vl.Qwen2VLVisionTransformer.__init__ = narrowed_vision_init


# --------------------------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------------------------

def _model_class(dotted: str) -> type:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def text_encoder_shapes(encoder: Encoder, num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                        widths: dict[str, int] | None = None,
                        vision: dict[str, int] | None = None) -> dict[str, torch.Size]:
    """Key names and shapes of ComfyUI's own text model of ``encoder``, built on the meta device: tiny, or of
    ``widths`` (``{}``: the real ones); its vision tower (Qwen2.5-VL) tiny, or of ``vision`` (``{}``: the real one)."""
    narrow_text_encoder_configs()
    import comfy.ops

    config = json.loads((comfyui_path() / encoder.json_config).read_text()) if encoder.json_config else {}
    layers = encoder.tiny[encoder.layers_key] if num_layers is None else num_layers
    if layers < encoder.min_layers:
        raise ValueError(f"num_layers={layers}: ComfyUI needs {encoder.min_layers} layers at least to tell "
                         f"{encoder.te_model} apart")
    config |= {**(encoder.tiny if widths is None else widths), encoder.layers_key: layers}
    with _vision_narrowed(encoder.vision if vision is None else vision):
        model = _model_class(encoder.model_class)(config, dtype, "meta", comfy.ops.disable_weight_init)
    return {key: value.shape for key, value in model.state_dict().items()}


def make_text_encoder(path: Path, encoder: str, num_layers: int | None = None, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, widths: dict[str, int] | None = None) -> Path:
    """Write the tiny ``encoder`` of :data:`ENCODERS` to ``path`` (the key layout of the real files), of its
    tiny widths or ``widths``."""
    spec = ENCODERS[encoder]
    tensors = fill_seeded(text_encoder_shapes(spec, num_layers, dtype, widths), seed, dtype)
    if spec.tokenizer is not None:
        tensors[spec.tokenizer] = torch.frombuffer(bytearray(_TOKENIZERS[spec.tokenizer]()), dtype=torch.uint8)
    return save_safetensors(tensors, path)


def text_encoder_file(encoder: str, *, dtype: torch.dtype | None = None, num_layers: int | None = None,
                      seed: int = 0) -> Path:
    """Cached :func:`make_text_encoder`: a tiny text-encoder file of :data:`ENCODERS` (``num_layers``, ``dtype``
    None: its defaults), loadable once :func:`narrow_text_encoder_configs` ran."""
    if encoder not in ENCODERS:
        raise ValueError(f"unknown text encoder {encoder!r}; one of {', '.join(ENCODERS)}")
    spec = ENCODERS[encoder]
    num_layers = spec.tiny[spec.layers_key] if num_layers is None else num_layers  # in the cache key
    return cached_fixture(f"tiny_te_{encoder}", make_text_encoder, encoder=encoder, num_layers=num_layers,
                          seed=seed, dtype=spec.dtype if dtype is None else dtype, widths=spec.tiny)


# --------------------------------------------------------------------------------------------
# Families: a loader node, its type and the files
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextEncoderFamily:
    """How a workflow loads a family's text encoder: ``loader`` (a ComfyUI node) with ``type`` (None: the loader
    has none) and the files of ``encoders`` (in the loader's ``clip_name1``, ``clip_name2``... order); ``width`` is
    the conditioning's last dimension with the tiny defaults, ``pooled`` the pooled output's width (None: the family
    has none)."""

    loader: str
    type: str | None
    encoders: tuple[str, ...]
    width: int
    pooled: int | None = None

    def available(self) -> bool:
        """Whether the ComfyUI in use has this family: its loader offers the type and detects every file's kind."""
        nodes = boot_comfyui_in_process()
        import comfy.sd

        inputs = nodes.NODE_CLASS_MAPPINGS[self.loader].INPUT_TYPES()["required"]
        tokenizers = {ENCODERS[name].tokenizer for name in self.encoders}
        return ((self.type is None or self.type in inputs["type"][0])
                and all(ENCODERS[name].te_model in comfy.sd.TEModel.__members__ for name in self.encoders)
                and ("tekken_model" not in tokenizers or comfyui_reads_tekken()))

    def inputs(self, names: dict[str, str]) -> dict[str, str]:
        """The loader's inputs for the files ``names`` (encoder -> file name in ``text_encoders``)."""
        files = [names[encoder] for encoder in self.encoders]
        inputs = ({"clip_name": files[0]} if len(files) == 1
                  else {f"clip_name{i}": name for i, name in enumerate(files, 1)})
        return inputs if self.type is None else {**inputs, "type": self.type}


_HIDDEN = _LLAMA_TINY["hidden_size"]
TEXT_ENCODER_FAMILIES: dict[str, TextEncoderFamily] = {
    "qwen_image": TextEncoderFamily("CLIPLoader", "qwen_image", ("qwen25_7b",), _HIDDEN),
    "wan": TextEncoderFamily("CLIPLoader", "wan", ("umt5_xxl",), _T5_TINY["d_model"]),
    "z_image": TextEncoderFamily("CLIPLoader", "lumina2", ("qwen3_4b",), _HIDDEN),
    "flux": TextEncoderFamily("DualCLIPLoader", "flux", ("clip_l", "t5_xxl"), _T5_TINY["d_model"],
                              _CLIP_TINY["projection_dim"]),
    "sdxl": TextEncoderFamily("DualCLIPLoader", "sdxl", ("clip_l", "clip_g"), 2 * _CLIP_TINY["hidden_size"],
                              _CLIP_TINY["projection_dim"]),
    # SD3 pads CLIP-L's and CLIP-G's outputs to T5-XXL's width and pools CLIP-L's hidden state unprojected.
    "sd3": TextEncoderFamily("DualCLIPLoader", "sd3", ("clip_l", "clip_g"), 4096,
                             _CLIP_TINY["hidden_size"] + _CLIP_TINY["projection_dim"]),
    # With the T5 beside them (the T5 owns the layers, as in the real SD3).
    "sd3_triple": TextEncoderFamily("TripleCLIPLoader", None, ("clip_l", "clip_g", "t5_xxl_4096"), 4096,
                                    _CLIP_TINY["hidden_size"] + _CLIP_TINY["projection_dim"]),
    # Flux.2 stacks the hidden states of layers 10, 20 and 30.
    "flux2": TextEncoderFamily("CLIPLoader", "flux2", ("mistral3_24b",), 3 * ENCODERS["mistral3_24b"].tiny["hidden_size"]),
}


# A CLIPSetLastLayer that changes what these families encode (SDXL takes layer -2 already; the others keep fixed
# layers).
CHANGING_LAST_LAYER = {"flux": -2, "sdxl": -3, "sd3": -3, "sd3_triple": -3}


def encode_text(clip, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CLIPTextEncode of ``text``, as a prompt runs it: the conditioning and its pooled output (or None)."""
    from testbed.run_nodes import node_output

    ((cond, extra),) = node_output("CLIPTextEncode", clip=clip, text=text)
    return cond, extra.get("pooled_output")


def use_text_encoders_in_process(models_dir: Path) -> dict[str, str]:
    """Link every tiny file of :data:`ENCODERS` into ``models_dir/text_encoders`` and make the in-process ComfyUI's
    loaders find them there; returns each encoder's file name, as the loaders take it."""
    boot_comfyui_in_process()
    narrow_text_encoder_configs()
    import folder_paths

    folder = Path(models_dir) / "text_encoders"
    names = {}
    for encoder in ENCODERS:
        source = text_encoder_file(encoder)
        link_or_copy(source, folder / source.name)
        names[encoder] = source.name
    if str(folder) not in folder_paths.get_folder_paths("text_encoders"):
        folder_paths.add_model_folder_path("text_encoders", str(folder), is_default=True)
    return names


# --------------------------------------------------------------------------------------------
# GGUF text encoders, as ComfyUI-GGUF's CLIPLoader (GGUF) reads them
# --------------------------------------------------------------------------------------------

# llama.cpp's tensor names -> ComfyUI's, the renames ComfyUI-GGUF makes for a llama-family text model (its
# ``loader.LLAMA_SD_MAP``, applied in this order); written the other way round.
_LLAMA_CPP_NAMES = {
    "blk.": "model.layers.", "attn_norm": "input_layernorm", "attn_q_norm.": "self_attn.q_norm.",
    "attn_k_norm.": "self_attn.k_norm.", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_norm": "post_attention_layernorm",
    "token_embd": "model.embed_tokens", "output_norm": "model.norm",
}


def llama_cpp_name(key: str) -> str:
    """A Qwen3 text model's ComfyUI key as llama.cpp names it (ComfyUI-GGUF renames it back)."""
    for gguf_name, comfy_name in reversed(_LLAMA_CPP_NAMES.items()):
        key = key.replace(comfy_name, gguf_name)
    return key


def make_text_encoder_gguf(path: Path, source: Path, qtype_name: str, seed: int = 0) -> Path:
    """A tiny Qwen3 file ``source`` (GGUF architecture ``qwen3``: no key permutation, no tokenizer in the file) as a
    GGUF text encoder, its matrices of type ``qtype_name`` (ComfyUI-GGUF's converter's policy)."""
    from testbed import gguf_files

    with safe_open(str(source), framework="pt") as tensors:
        state_dict = {llama_cpp_name(key): tensors.get_tensor(key).float() for key in tensors.keys()}
    return gguf_files.write_gguf(path, state_dict, getattr(gguf_files.QType, qtype_name), arch="qwen3", seed=seed)


def text_encoder_gguf_file(qtype_name: str = "Q8_0", seed: int = 0) -> Path:
    """The tiny Qwen3-4B (Z-Image's text encoder) as a GGUF file, made once per type beside its safetensors file."""
    source = text_encoder_file("qwen3_4b", seed=seed)
    path = source.with_name(f"{source.stem}-{qtype_name}.gguf")
    return path if path.exists() else make_text_encoder_gguf(path, source, qtype_name, seed)
