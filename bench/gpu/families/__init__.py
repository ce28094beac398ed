"""One room per family of rows; each family runs in a process of its own (see ``runner``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import BenchConfig
from .baselines import baselines_family
from .box import box_family
from .compile import COMPILE_SYSTEMS, compile_family
from .fp8 import fp8_family
from .gguf import gguf_family
from .legacy import legacy_family
from .lora import lora_rows
from .pack import auto_family, pack_family
from .shipped import shipped_family
from .text_encoder import TEXT_ENCODER_SYSTEMS, text_encoder_family

WORKERS: dict[str, Callable[[BenchConfig, Path], None]] = {
    "shipped": shipped_family, "auto": auto_family, "fp8": fp8_family, "gguf": gguf_family,
    **{system: compile_family(system) for system in COMPILE_SYSTEMS}, "box": box_family,
    **{system: text_encoder_family(system) for system in TEXT_ENCODER_SYSTEMS}, "legacy": legacy_family,
    "pack": pack_family, "lora": lambda config, out: lora_rows("lora", config, out),
    "lora-native": lambda config, out: lora_rows("lora-native", config, out), "baselines": baselines_family}
