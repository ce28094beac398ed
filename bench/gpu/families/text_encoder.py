"""The text encoder at a small card (issue 46, item 7): a Qwen2.5-VL-7B-shaped bf16 text encoder (ComfyUI's own
``Qwen25_7BVLI`` at its real widths: hidden 3584, 28 layers, feed-forward 18944, vocabulary 152064, and its vision
tower; 15.5 GB) written on the machine's disk once, the card capped at ``te_cap_bytes`` (12 GiB) by the balloon,
and each path in a process of its own (one family each, ``text_encoder`` names them all):

- ``te-dynamic``    ComfyUI as shipped, Load CLIP under Dynamic VRAM (skipped where comfy-aimdo does not start:
                    without CUDA, or on a ComfyUI without it);
- ``te-legacy``     Load CLIP, ``--disable-dynamic-vram``: ComfyUI's legacy partial load;
- ``te-pageable``   the same with ``--disable-pinned-memory``;
- ``te-lowvram``    the same with ``--lowvram``: ComfyUI encodes on the CPU;
- ``te-node-p0``, ``te-node-p1``  Load CLIP → Group Offload (text encoder), ``auto``, prefetch 0 and 1;
- ``te-loader-p1``  Load CLIP (Group Offload), ``auto``, prefetch 1.

Per path, each encode a prompt not encoded before (CLIPTextEncode): the *first encode* right after the load; the
*steady encode* (median of ``te_prompts``) with the encoder where the last encode left it; the *prompt change*
(median of ``te_prompts``, the figure users wait for): an encode after ``unload_all_models()``, what the diffusion
model does to the text encoder when it takes the card between two prompts. Also the load's seconds, the peak
anonymous memory (``RssAnon``, sampled) above the process's before the load, the peak RSS, the pinned bytes, and
the conditioning's max |Δ| against ComfyUI's (Dynamic VRAM's, else legacy's; the lowvram path encodes on the CPU,
so its Δ is the CPU's arithmetic). The file and the conditionings stay in the scratch folder until the parent
removes them (:func:`remove_files`). A path stops its encodes past ``row_limit_s`` and keeps what it measured."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from testbed.host_memory import PeakAnonymous, peak_rss_bytes, reset_peak, rss_anon_bytes

from ..balloon import Balloon
from ..comfyui import start_comfyui
from ..config import ROWS, BenchConfig, Row, emit
from ..files import disk_room, scratch_dir, shapes_size, use_folder_for_models, write_shapes
from ..sampling import end_row, offload_handle
from ..timing import synchronize
from ..weights import eager_weights

ENCODER = "qwen25_7b"  # testbed.text_encoders.ENCODERS: ComfyUI's Qwen2.5-VL-7B
REFERENCES = ("te-dynamic", "te-legacy")  # ComfyUI's conditioning: the first of these that ran
PROMPTS = ("a photograph of a cat on a windowsill, morning light", "a lighthouse at dusk, long shadows over the sea",
           "an old map of a harbour town, ink and watercolour", "a red bicycle leaning on a stone wall, rain",
           "a bowl of ramen on a wooden table, steam, close-up", "a snowy mountain pass at night under the stars",
           "a city street in the 1920s, people in hats, sepia", "a glass of water on a desk beside an open notebook")


@dataclass(frozen=True)
class TextEncoderPath:
    """One way of loading and encoding: ComfyUI's flags, its Dynamic VRAM or not, and the pack's node, if any."""

    system: str
    mode: str
    dynamic: bool
    flags: dict[str, bool] = field(default_factory=dict)
    loader: str = "CLIPLoader"
    node: str | None = None
    prefetch: int | None = None

    def load(self, name: str) -> Any:
        """The CLIP, as a workflow loads it: the loader, then the pack's node where there is one."""
        from testbed.run_nodes import node_output

        settings = {"blocks_per_group": 1, "prefetch": self.prefetch, "residency": "auto", "resident_gb": 0.0}
        extra = settings if self.loader != "CLIPLoader" else {}
        clip = node_output(self.loader, clip_name=name, type="qwen_image", **extra)
        return clip if self.node is None else node_output(self.node, clip=clip, **settings)


LEGACY = {"disable_dynamic_vram": True}
PATHS: dict[str, TextEncoderPath] = {
    "te-dynamic": TextEncoderPath("ComfyUI (Dynamic VRAM)", "Load CLIP", dynamic=True),
    "te-legacy": TextEncoderPath("ComfyUI legacy", "Load CLIP, --disable-dynamic-vram", False, LEGACY),
    "te-pageable": TextEncoderPath("ComfyUI legacy", "Load CLIP, --disable-pinned-memory", False,
                                   {**LEGACY, "disable_pinned_memory": True}),
    "te-lowvram": TextEncoderPath("ComfyUI legacy", "Load CLIP, --lowvram (CPU encode)", False,
                                  {**LEGACY, "lowvram": True}),
    "te-node-p0": TextEncoderPath("this pack", "Load CLIP → Group Offload (text encoder), auto, prefetch 0", True,
                                  node="GroupOffloadTextEncoder", prefetch=0),
    "te-node-p1": TextEncoderPath("this pack", "Load CLIP → Group Offload (text encoder), auto, prefetch 1", True,
                                  node="GroupOffloadTextEncoder", prefetch=1),
    "te-loader-p1": TextEncoderPath("this pack", "Load CLIP (Group Offload), auto, prefetch 1", True,
                                    loader="GroupOffloadCLIPLoader", prefetch=1),
}
TEXT_ENCODER_SYSTEMS = tuple(PATHS)


def _file_path(config: BenchConfig) -> Path:
    size = "tiny" if config.te_tiny else "bf16"
    return scratch_dir() / f"qwen25_vl_7b_{config.te_layers}_layers_{size}.safetensors"


def _conds_path(config: BenchConfig, family: str) -> Path:
    return _file_path(config).with_name(f"{_file_path(config).stem}-{family}-conds.pt")


def _shapes(config: BenchConfig) -> dict[str, torch.Size]:
    """ComfyUI's own Qwen2.5-VL-7B on the meta device: its real widths and vision tower, or the test bed's tiny
    ones (which the test bed's narrowing makes ComfyUI load)."""
    from testbed.text_encoders import ENCODERS, narrow_text_encoder_configs, text_encoder_shapes

    narrow_text_encoder_configs()  # (a no-op for full-width files: ComfyUI detects and builds them as they are)
    encoder = ENCODERS[ENCODER]
    widths, vision = (None, None) if config.te_tiny else ({}, {})
    with eager_weights():
        return text_encoder_shapes(encoder, config.te_layers, torch.bfloat16, widths, vision)


def ensure_file(config: BenchConfig) -> tuple[str | None, str | None]:
    """The encoder's file name in the scratch folder, written (then renamed into place) by the first family that
    finds it missing; else None and why it cannot be written."""
    path, shapes = _file_path(config), _shapes(config)
    use_folder_for_models(path.parent, "text_encoders")
    if path.exists():
        return path.name, None
    why = disk_room(path.parent, shapes_size(shapes, torch.bfloat16))
    if why is not None:
        return None, why
    partial = path.with_suffix(".partial")
    written = write_shapes(partial, shapes, torch.bfloat16, config.pool_numel)
    os.replace(partial, path)
    emit("fact", {"te_file": {**written, "layers": config.te_layers, "full_size": not config.te_tiny}})
    return path.name, None


def _encode(clip: Any, text: str, device: torch.device) -> tuple[float, torch.Tensor]:
    """One CLIPTextEncode of ``text``: its seconds and the conditioning (float32, on the CPU)."""
    from testbed.text_encoders import encode_text

    started = time.perf_counter()
    cond, _ = encode_text(clip, text)
    synchronize(device)
    return time.perf_counter() - started, cond.float().cpu()


def _encodes(row: Row, clip: Any, config: BenchConfig) -> list[torch.Tensor]:
    """The first encode, the steady ones, then the prompt changes (each after ``unload_all_models``), in the
    row's figures, until ``row_limit_s`` passes; the conditionings, in prompt order."""
    import comfy.model_management as mm

    plan: list[tuple[list[float] | None, Callable[[], None] | None]] = [(None, None)]
    plan += [(row.step_s, None)] * config.te_prompts + [(row.change_s, mm.unload_all_models)] * config.te_prompts
    if len(plan) > len(PROMPTS):
        raise ValueError(f"te_prompts={config.te_prompts}: {len(PROMPTS)} prompts make at most "
                         f"{(len(PROMPTS) - 1) // 2} steady encodes and as many prompt changes")
    conds, started = [], time.perf_counter()
    for text, (figures, before) in zip(PROMPTS, plan):
        if time.perf_counter() - started > config.row_limit_s:
            row.note = f"stopped past the row's {config.row_limit_s:.0f} s after {len(conds)} encodes"
            break
        if before is not None:
            before()
        seconds, cond = _encode(clip, text, config.device)
        if figures is None:
            row.first_step_s = seconds
        else:
            figures.append(seconds)
        conds.append(cond)
    return conds


def _compare(row: Row, family: str, conds: list[torch.Tensor], config: BenchConfig) -> None:
    """Keep this path's conditioning; its max |Δ| against ComfyUI's (the first reference that ran)."""
    torch.save(conds, _conds_path(config, family))
    reference = next((name for name in REFERENCES if _conds_path(config, name).exists()), None)
    if reference is None:
        row.note = "; ".join(filter(None, [row.note, "no ComfyUI path ran before it: nothing to compare with"]))
        return
    theirs = torch.load(_conds_path(config, reference))
    row.max_abs_diff = max((a - b).abs().max().item() for a, b in zip(conds, theirs))
    if reference == family:
        row.note = "; ".join(filter(None, [row.note, "the reference conditioning"]))


def measure(row: Row, family: str, path: TextEncoderPath, name: str, config: BenchConfig) -> None:
    """Load at the cap, encode, and fill the row."""
    import comfy.model_management as mm

    Balloon(config.device).set_cap(row.cap_bytes)
    reset_peak()
    before = rss_anon_bytes()
    with PeakAnonymous() as peak:
        started = time.perf_counter()
        clip = path.load(name)
        row.load_s = time.perf_counter() - started
        conds = _encodes(row, clip, config)
    row.peak_anon_bytes, row.peak_rss_bytes = peak.peak - before, peak_rss_bytes()
    row.comfy_pinned_bytes = getattr(mm, "TOTAL_PINNED_MEMORY", None)
    handle = offload_handle(clip.patcher)
    if handle is not None:
        row.pinned_bytes = handle.stats()["pinned_bytes"]
    _compare(row, family, conds, config)


def _file_or_why(path: TextEncoderPath, patcher: str, config: BenchConfig) -> tuple[str | None, str | None]:
    """The encoder's file name, or None and why the path cannot run (Dynamic VRAM's, where it did not start)."""
    if path.system == "ComfyUI (Dynamic VRAM)" and "Dynamic" not in patcher:
        return None, f"needs Dynamic VRAM; this process runs the {patcher}"
    return ensure_file(config)


def text_encoder_family(family: str) -> Callable[[BenchConfig, Path], None]:
    """The worker of one path of :data:`PATHS`."""
    path = PATHS[family]

    def run(config: BenchConfig, out: Path) -> None:
        patcher = start_comfyui(config, dynamic=path.dynamic, flags=path.flags)
        size = "tiny" if config.te_tiny else "full size"
        row = Row(family, path.system, path.mode, f"bf16, {size}, {config.te_layers} layers", config.te_cap_bytes)
        if not ROWS.begin(row, config):
            return
        name, row.skipped = _file_or_why(path, patcher, config)
        try:
            if row.skipped is None:
                measure(row, family, path, name, config)
        except torch.cuda.OutOfMemoryError as error:
            row.skipped = f"out of memory: {str(error).splitlines()[0][:160]}"
        end_row(row)
    return run


def remove_files(config: BenchConfig) -> None:
    """The encoder's file and the paths' conditionings, once the families are done (the parent calls it)."""
    path = _file_path(config)
    for stale in (path, path.with_suffix(".partial"), *(_conds_path(config, name) for name in PATHS)):
        stale.unlink(missing_ok=True)
