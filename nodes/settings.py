"""What the user chose on a Group Offload node: checked in one place, carried by every clone of the model."""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1024**3
RESIDENCY_MODES = ("auto", "stream_all", "budget")
HOST_MEMORY_MODES = ("auto", "budget")
#: The node inputs' bounds for ``resident_gb`` and ``host_gb`` (GB).
GB_INPUT_MIN, GB_INPUT_MAX = 0.0, 4096.0


@dataclass(frozen=True)
class OffloadSettings:
    """The node's inputs, by name, and the node whose UI shows the telemetry."""

    blocks_per_group: int = 1
    prefetch: int = 1
    residency: str = "auto"
    resident_gb: float = 0.0
    host_memory: str = "auto"
    host_gb: float = 0.0
    node_id: str | None = None

    def validate(self) -> None:
        """``ValueError`` naming the input that is out of range (the node's input validation and its run
        both call this)."""
        _check_choice("residency", self.residency, RESIDENCY_MODES)
        _check_choice("host_memory", self.host_memory, HOST_MEMORY_MODES)
        if self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be at least 1, got {self.blocks_per_group}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {self.prefetch}")
        _check_gb("resident_gb", self.resident_gb)
        _check_gb("host_gb", self.host_gb)

    def resident_bytes(self) -> int:
        """``resident_gb`` in bytes: what ``budget`` keeps resident."""
        return int(self.resident_gb * GB)

    def host_bytes(self) -> int:
        """``host_gb`` in bytes: the packed host copies ``host_memory = budget`` allows all offloaded models."""
        return int(self.host_gb * GB)

    def handle_layout(self) -> tuple:
        """The settings a handle is built for: a change of any of them needs a new handle (residency re-plans)."""
        return self.blocks_per_group, self.prefetch, self.host_memory, self.host_gb


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_gb(name: str, value: float) -> None:
    if not (math.isfinite(value) and GB_INPUT_MIN <= value <= GB_INPUT_MAX):
        raise ValueError(f"{name} must be a finite number from {GB_INPUT_MIN:g} to {GB_INPUT_MAX:g} (GB), got {value}")
