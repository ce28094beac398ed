"""Seconds per sampling step of a group-offloaded diffusion transformer: a bandwidth/throughput model.

A pass costs ``compute = FLOPs / (bf16 peak × utilization)`` and ``transfer = streamed bytes / host-to-device
bandwidth`` (+ copied-back bytes / device-to-host bandwidth for the copy-back baseline): their sum when onloads
are synchronous, the larger of the two when they are prefetched on a side stream; a step is ``passes ×`` that.
Each figure's source is noted where it is defined ("peers.md": the project's survey of peer projects, §4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from offload_core.slabs import slabs_for

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """A GPU and its host link.  Bandwidths in GB/s (10⁹ B/s), throughput in TFLOPS."""

    name: str
    bf16_tflops: float
    memory_bytes: int
    h2d_pinned_gbps: float
    h2d_pageable_gbps: float
    d2h_pageable_gbps: float
    utilization: float = 0.6  # of the bf16 dense peak, for the whole pass (peers.md)


# 312 TFLOPS dense (peers.md); pinned: the PCIe Gen4 x16 link as measured (bam #54); pageable host-to-device
# taken equal to it, as no primary figure exists and the seed needs ≥ 22 GB/s (``implied_bandwidths``);
# device-to-host into pageable memory from pytorch #138018.
A100_40G = Gpu("A100 40G", bf16_tflops=312, memory_bytes=40 * GIB,
               h2d_pinned_gbps=25.0, h2d_pageable_gbps=25.0, d2h_pageable_gbps=1.4)
# 989 TFLOPS dense (NVIDIA's datasheet); pinned: the one published H100 measurement on the same PCIe Gen5 x16 link
# (nvbandwidth #24); pageable both ways: "H200 offload" (sglang #32032).
H200 = Gpu("H200", bf16_tflops=989, memory_bytes=141 * GB,
           h2d_pinned_gbps=35.0, h2d_pageable_gbps=2.8, d2h_pageable_gbps=2.8)


@dataclass(frozen=True)
class DiT:
    """A double-stream (MMDiT) transformer; the defaults are Qwen-Image's, as ComfyUI's
    ``comfy/ldm/qwen_image/model.py`` builds it (``block_params`` gives its 339,831,296 per block)."""

    blocks: int = 60
    dim: int = 3072
    heads: int = 24
    ffn: int = 12288
    joint_dim: int = 3584
    in_channels: int = 64  # 16 latent channels × 2×2 patch
    timestep_channels: int = 256
    bytes_per_param: int = 2  # bf16

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def block_params(self) -> int:
        """Modulation (2 × d→6d), attention (q, k, v, out for each stream, 4 head-wise RMSNorms), two MLPs."""
        d = self.dim
        modulation = 2 * (6 * d * d + 6 * d)
        attention = 8 * (d * d + d) + 4 * self.head_dim
        mlps = 2 * (2 * d * self.ffn + self.ffn + d)
        return modulation + attention + mlps

    def other_params(self) -> int:
        """Everything outside the blocks: embedders, text norm, final modulation and projection."""
        d = self.dim
        img_in = self.in_channels * d + d
        txt = self.joint_dim + self.joint_dim * d + d  # txt_norm, txt_in
        time = self.timestep_channels * d + d + d * d + d
        out = d * 2 * d + 2 * d + d * self.in_channels + self.in_channels  # norm_out, proj_out
        return img_in + txt + time + out

    @property
    def block_bytes(self) -> int:
        return self.block_params() * self.bytes_per_param

    @property
    def other_bytes(self) -> int:
        return self.other_params() * self.bytes_per_param

    @property
    def total_bytes(self) -> int:
        return self.blocks * self.block_bytes + self.other_bytes

    def block_flops(self, image_tokens: int, text_tokens: int) -> float:
        """One block, one sample: the token-wise matmuls, joint attention and the modulation."""
        tokens = image_tokens + text_tokens
        matmuls = 2 * tokens * (4 * self.dim**2 + 2 * self.dim * self.ffn)
        attention = 4 * tokens**2 * self.dim
        modulation = 2 * 2 * 6 * self.dim**2
        return matmuls + attention + modulation

    def pass_flops(self, image_tokens: int, text_tokens: int, batch: int) -> float:
        d = self.dim
        outside = 2 * (2 * self.in_channels * d * image_tokens + self.joint_dim * d * text_tokens)
        return batch * (self.blocks * self.block_flops(image_tokens, text_tokens) + outside)


QWEN_IMAGE = DiT()


@dataclass(frozen=True)
class Workload:
    """One sampling step: the image size, the text length and how classifier-free guidance runs."""

    width: int = 1664
    height: int = 928
    text_tokens: int = 128  # the seed's prompt is ≈100 tokens; the text changes a pass by < 2 %
    cfg_batched: bool = True  # ComfyUI: one pass of batch 2; False: two passes of batch 1 (diffusers true CFG)

    @property
    def image_tokens(self) -> int:
        return (self.width // 16) * (self.height // 16)  # 8× VAE, 2×2 patches

    @property
    def passes(self) -> int:
        return 1 if self.cfg_batched else 2

    @property
    def batch(self) -> int:
        return 2 if self.cfg_batched else 1


COMFYUI_CFG = Workload()
DIFFUSERS_TRUE_CFG = Workload(cfg_batched=False)


class Transfer(Enum):
    """How the streamed weights move, per group."""

    COPY_BACK = "copy-back"  # diffusers use_stream=False before PR #12910: pageable in, pageable back out, synchronous
    PAGEABLE_SYNC = "pageable, synchronous"  # PR #12910: pageable in, no copy-back, synchronous
    PINNED_SYNC = "pinned, synchronous"  # this pack, prefetch 0
    PINNED_PREFETCH = "pinned, prefetched"  # this pack, prefetch >= 1


@dataclass(frozen=True)
class Plan:
    """What is streamed and how: ``resident_blocks`` stay on the device; diffusers also streams the rest."""

    transfer: Transfer
    resident_blocks: int = 0
    stream_other: bool = False  # diffusers offloads the top-level weights as one more group


@dataclass(frozen=True)
class Estimate:
    compute_s: float  # per step
    transfer_s: float  # per step, both directions
    seconds: float  # per step
    streamed_bytes: int  # host-to-device, per step
    resident_blocks: int


def pass_seconds(compute_s: float, h2d_bytes: float, h2d_gbps: float, d2h_bytes: float = 0.0,
                 d2h_gbps: float = math.inf, overlap: bool = False) -> float:
    """One pass: compute plus copies, or the larger of the two when the host-to-device copies overlap.

    Device-to-host copy-back never overlaps (diffusers runs it synchronously after each group).
    """
    h2d = h2d_bytes / (h2d_gbps * GB)
    d2h = d2h_bytes / (d2h_gbps * GB) if d2h_bytes else 0.0
    return (max(compute_s, h2d) if overlap else compute_s + h2d) + d2h


def predict(gpu: Gpu, plan: Plan, workload: Workload = COMFYUI_CFG, model: DiT = QWEN_IMAGE) -> Estimate:
    """Seconds per step of ``model`` on ``gpu`` under ``plan``."""
    if not 0 <= plan.resident_blocks <= model.blocks:
        raise ValueError(f"resident_blocks must be in 0..{model.blocks}, got {plan.resident_blocks}")
    flops = model.pass_flops(workload.image_tokens, workload.text_tokens, workload.batch)
    compute = flops / (gpu.bf16_tflops * 1e12 * gpu.utilization)
    streamed = (model.blocks - plan.resident_blocks) * model.block_bytes + (model.other_bytes if plan.stream_other else 0)
    pinned = plan.transfer in (Transfer.PINNED_SYNC, Transfer.PINNED_PREFETCH)
    h2d_gbps = gpu.h2d_pinned_gbps if pinned else gpu.h2d_pageable_gbps
    d2h = streamed if plan.transfer is Transfer.COPY_BACK else 0
    per_pass = pass_seconds(compute, streamed, h2d_gbps, d2h, gpu.d2h_pageable_gbps,
                            overlap=plan.transfer is Transfer.PINNED_PREFETCH)
    transfer = streamed / (h2d_gbps * GB) + (d2h / (gpu.d2h_pageable_gbps * GB) if d2h else 0.0)
    n = workload.passes
    return Estimate(n * compute, n * transfer, n * per_pass, n * streamed, plan.resident_blocks)


def auto_resident_blocks(cap_bytes: float, model: DiT = QWEN_IMAGE, reserve_bytes: float = 4 * GIB,
                         prefetch: int = 1) -> int:
    """Blocks the pack's ``auto`` residency keeps on a device capped at ``cap_bytes``: what is left after the
    reserve (activations, the CUDA context, ComfyUI's own: an estimate ``gpu_benchmark.py`` measures), the
    weights outside the blocks and the streaming slabs."""
    budget = cap_bytes - reserve_bytes - model.other_bytes - slabs_for(prefetch) * model.block_bytes
    return max(0, min(model.blocks, int(budget // model.block_bytes)))


# --- the seed and the predictions -------------------------------------------------------------

#: diffusers PR #12910 (A100 40G, Qwen-Image, 1664×928, true_cfg_scale 4 with a negative prompt).
SEED_MEASURED_S = {"copy-back": 54.0, "no copy-back": 4.8}
SEED_PLANS = {
    "copy-back": Plan(Transfer.COPY_BACK, stream_other=True),
    "no copy-back": Plan(Transfer.PAGEABLE_SYNC, stream_other=True),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu: Gpu
    plan: Plan
    workload: Workload = COMFYUI_CFG
    measured_s: float | None = None
    source: str = ""

    def estimate(self) -> Estimate:
        return predict(self.gpu, self.plan, self.workload)


def seed_scenarios() -> list[Scenario]:
    return [Scenario(f"A100 40G, diffusers {name} (seed)", A100_40G, plan, DIFFUSERS_TRUE_CFG,
                     SEED_MEASURED_S[name], "diffusers PR #12910") for name, plan in SEED_PLANS.items()]


def pack_scenarios(reserve_bytes: float = 4 * GIB) -> list[Scenario]:
    """What this pack should reach (ComfyUI batches CFG), with and without residency."""
    def auto(gpu: Gpu, cap: float) -> Plan:
        return Plan(Transfer.PINNED_PREFETCH, auto_resident_blocks(cap, reserve_bytes=reserve_bytes))

    return [
        Scenario("A100 40G, pack, stream_all, prefetch 0", A100_40G, Plan(Transfer.PINNED_SYNC)),
        Scenario("A100 40G, pack, stream_all, prefetch 1", A100_40G, Plan(Transfer.PINNED_PREFETCH)),
        Scenario("A100 40G, pack, auto residency (40 GiB)", A100_40G, auto(A100_40G, A100_40G.memory_bytes)),
        Scenario("H200, all resident (no offload)", H200, Plan(Transfer.PINNED_PREFETCH, QWEN_IMAGE.blocks)),
        Scenario("H200, pack, stream_all, prefetch 1", H200, Plan(Transfer.PINNED_PREFETCH)),
        Scenario("H200 capped at 40 GiB, pack, auto residency", H200, auto(H200, 40 * GIB)),
        Scenario("H200 capped at 24 GiB, pack, auto residency", H200, auto(H200, 24 * GIB)),
    ]


def implied_bandwidths() -> dict[str, float]:
    """The bandwidths (GB/s) the seed's two figures imply under this model, for comparison."""
    model, workload = QWEN_IMAGE, DIFFUSERS_TRUE_CFG
    compute = predict(A100_40G, SEED_PLANS["no copy-back"], workload).compute_s
    streamed = workload.passes * (model.blocks * model.block_bytes + model.other_bytes)
    no_copy_back, copy_back = SEED_MEASURED_S["no copy-back"], SEED_MEASURED_S["copy-back"]
    return {
        "h2d_pageable_gbps": streamed / (no_copy_back - compute) / GB,
        "d2h_pageable_gbps": streamed / (copy_back - no_copy_back) / GB,
    }


def with_bandwidth(gpu: Gpu, factor: float) -> Gpu:
    """``gpu`` with every bandwidth scaled by ``factor`` (for sensitivity checks)."""
    return replace(gpu, h2d_pinned_gbps=gpu.h2d_pinned_gbps * factor,
                   h2d_pageable_gbps=gpu.h2d_pageable_gbps * factor,
                   d2h_pageable_gbps=gpu.d2h_pageable_gbps * factor)
