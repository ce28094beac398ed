"""One room per family of rows; each family runs in a process of its own (see ``runner``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import BenchConfig
from .baselines import baselines_family
from .fp8 import fp8_family
from .legacy import legacy_family
from .lora import lora_rows
from .pack import pack_family
from .shipped import shipped_family

WORKERS: dict[str, Callable[[BenchConfig, Path], None]] = {
    "pack": pack_family, "shipped": shipped_family, "lora": lambda config, out: lora_rows("lora", config, out),
    "lora-native": lambda config, out: lora_rows("lora-native", config, out), "fp8": fp8_family,
    "baselines": baselines_family, "legacy": legacy_family}
