"""Tiny stand-ins for diffusion models of newer ComfyUI (0.38.1) that call their blocks in ways other than
one ``forward`` per block per call, written from the call structure of their public source (none of their
code): their ``forward`` takes what ComfyUI's ``apply_model`` passes (``x, timesteps, context, ...``).

- ``PrismLike`` (comfy/ldm/prism/model.py): ``fusion_blocks`` pair a video and an audio block with two
  cross-modal conditioners and have no ``forward``; the model calls the four parts one by one, then the
  ``remaining_video_blocks``. The blocks read a ``modulation`` Parameter of their own in their ``forward``.
- ``SenseNovaLike`` (comfy/ldm/sensenova/model.py): each layer runs through ``forward_prefix`` then
  ``forward_generation``, its attention through methods of the same names (no ``forward``), its MLPs and
  norms through their ``forward``; the prefix's keys and values feed the generation.
- ``QwenImage21Like`` (comfy/ldm/qwen_image21/model.py): on a cache-fill call each block runs twice, on
  the prefix and then on the image; later calls run each block once against the cached prefix.
- ``Kandinsky6Like`` (comfy/ldm/kandinsky6/model.py): a MagCache-like skip; a skipped call runs no block
  and reuses the residual of the last computed one. Its blocks read a modulation Linear's weight through
  ``F.linear`` inside their ``forward``, as its fp32 helpers do.
- ``OutsideUseLike``: reads a block's weight straight from the model's own code, which nothing can stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from testbed.dit_families import MODELS, build, noise, text
from testbed.pack_modules import pack_module

WIDTH = 32


def _ops():
    import comfy.ops

    return comfy.ops.disable_weight_init


class Mlp(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        ops = _ops()
        self.up, self.down = ops.Linear(width, 2 * width), ops.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class DiTBlock(nn.Module):
    """Self-attention-free: a norm, a modulation Parameter read in ``forward``, an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _ops().LayerNorm(WIDTH)
        self.mlp = Mlp()
        self.modulation = nn.Parameter(torch.zeros(1, 2, WIDTH))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation + context.mean(1, keepdim=True)).unbind(1)
        return x + self.mlp(self.norm(x) * (1 + scale) + shift)


class Conditioner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ops = _ops()
        self.y_norm = ops.LayerNorm(WIDTH)
        self.proj = ops.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.proj(self.y_norm(other).mean(1, keepdim=True)) * 0.5 + x * 0


class FusedBlock(nn.Module):
    """No ``forward``: the model calls its parts."""

    def __init__(self) -> None:
        super().__init__()
        self.video_block, self.audio_block = DiTBlock(), DiTBlock()
        self.a2v_conditioner, self.v2a_conditioner = Conditioner(), Conditioner()


class _StandIn(nn.Module):
    """Embedding in, head out, around the blocks; what ``apply_model`` calls."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        ops = _ops()
        self.dtype = torch.float32
        self.embed, self.head = ops.Linear(channels, WIDTH), ops.Linear(WIDTH, channels)
        self.context_in = ops.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor | None = None,
                transformer_options: dict | None = None, **kwargs) -> torch.Tensor:
        tokens = self.embed(x.movedim(1, -1).flatten(1, -2)) + 1e-3 * timesteps.view(-1, 1, 1)
        tokens = self.run_blocks(tokens, self.context_in(context))
        return self.head(tokens).movedim(-1, 1).reshape(x.shape)

    def run_blocks(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PrismLike(_StandIn):
    def __init__(self) -> None:
        super().__init__()
        self.fusion_blocks = nn.ModuleList(FusedBlock() for _ in range(3))
        self.remaining_video_blocks = nn.ModuleList(DiTBlock() for _ in range(2))

    def run_blocks(self, video: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        audio = video.flip(1)
        for fused in self.fusion_blocks:
            before_video = video
            video = video + fused.a2v_conditioner(video, audio)
            audio = audio + fused.v2a_conditioner(audio, before_video)
            video = fused.video_block(video, context)
            audio = fused.audio_block(audio, context)
        for block in self.remaining_video_blocks:
            video = block(video, context)
        return video + audio


class Attention(nn.Module):
    """Projections for the prefix and for the generation; no ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        ops = _ops()
        self.qkv, self.qkv_gen = ops.Linear(WIDTH, 3 * WIDTH), ops.Linear(WIDTH, 3 * WIDTH)
        self.out, self.out_gen = ops.Linear(WIDTH, WIDTH), ops.Linear(WIDTH, WIDTH)

    def forward_prefix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v)), k, v

    def forward_generation(self, x: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_gen(x).chunk(3, dim=-1)
        k, v = torch.cat((prefix_k, k), dim=1), torch.cat((prefix_v, v), dim=1)
        return self.out_gen(F.scaled_dot_product_attention(q, k, v))


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ops = _ops()
        self.self_attn = Attention()
        self.mlp, self.mlp_gen = Mlp(), Mlp()
        self.norm, self.norm_gen = ops.RMSNorm(WIDTH), ops.RMSNorm(WIDTH)

    def forward_prefix(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attention, k, v = self.self_attn.forward_prefix(self.norm(prefix))
        prefix = prefix + attention
        return prefix + self.mlp(prefix), k, v

    def forward_generation(self, image: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> torch.Tensor:
        image = image + self.self_attn.forward_generation(self.norm_gen(image), prefix_k, prefix_v)
        return image + self.mlp_gen(image)


class SenseNovaLike(_StandIn):
    """``cached_calls``: the indices of the calls (counted in ``calls``) given the prefix's keys and values
    the last call computed (``kv_cache``), as SenseNovaGenerate precomputes them: those skip ``forward_prefix``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(4))
        self.cached_calls: set[int] = set()
        self.calls = 0
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def run_blocks(self, image: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        cached = self.kv_cache if call in self.cached_calls else None
        prefix, computed = context, []
        for i, layer in enumerate(self.layers):
            if cached is None:
                prefix, k, v = layer.forward_prefix(prefix)
                computed.append((k, v))
            else:
                k, v = cached[i]
            image = layer.forward_generation(image, k, v)
        self.kv_cache = computed or self.kv_cache
        return image


class QwenImage21Like(_StandIn):
    """``prefix_cache`` (block index -> the prefix it gave) is filled by the first call; clear it to start over."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(DiTBlock() for _ in range(4))
        self.prefix_cache: dict[int, torch.Tensor] = {}

    def run_blocks(self, image: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        prefix = context
        for i, block in enumerate(self.transformer_blocks):
            if i not in self.prefix_cache:
                self.prefix_cache[i] = prefix = block(prefix, context)  # the cache-fill pass of the same block
            image = block(image, self.prefix_cache[i])
        return image


class FusedDecoderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ops = _ops()
        self.modulation = nn.Sequential(nn.SiLU(), ops.Linear(WIDTH, WIDTH))
        self.video, self.audio = Mlp(), Mlp()

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        linear = self.modulation[1]  # read straight, as Kandinsky 6's fp32 helpers read a Linear
        gate = F.linear(F.silu(context.mean(1, keepdim=True)), linear.weight, linear.bias)
        return x + gate * self.video(x) + self.audio(x)


class Kandinsky6Like(_StandIn):
    """``skip_calls``: the indices of the calls (counted in ``calls``) that reuse the last residual."""

    def __init__(self) -> None:
        super().__init__()
        self.visual_blocks = nn.ModuleList(FusedDecoderBlock() for _ in range(4))
        self.skip_calls: set[int] = set()
        self.calls = 0
        self.residual: torch.Tensor | None = None

    def run_blocks(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call in self.skip_calls and self.residual is not None:
            return tokens + self.residual
        out = tokens
        for block in self.visual_blocks:
            out = block(out, context)
        self.residual = out - tokens
        return out


class OutsideUseLike(_StandIn):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(4))

    def run_blocks(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            tokens = tokens + F.linear(F.gelu(F.linear(tokens, block.up.weight)), block.down.weight)
        return tokens


HOST = MODELS["wan21"]  # the ComfyUI model whose diffusion model the stand-in replaces: its conds, its latent


def with_stand_in(diffusion_model: torch.nn.Module):
    """A plain ModelPatcher of ComfyUI's Wan 2.1 BaseModel running ``diffusion_model``, its tensors seeded."""
    patcher = build(HOST)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor in diffusion_model.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    patcher.model.diffusion_model = diffusion_model
    return patcher


def call(patcher, step: int) -> torch.Tensor:
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    with torch.inference_mode():
        return patcher.model.apply_model(noise(*HOST.latent, seed=step), torch.full(HOST.latent[:1], 0.9 - 0.2 * step),
                                         c_crossattn=text())


def handle_for(model: torch.nn.Module):
    """The handle on ``model``'s blocks (the node builds it as ComfyUI first loads the model), or None."""
    return pack_module("offload_core").handle_of(pack_module("nodes.blocks").find_blocks(model)[0])
