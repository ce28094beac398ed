"""What the user chose on a Group Offload node: checked in one place, carried by every clone of the model."""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1024**3
RESIDENCY_MODES = ("auto", "stream_all", "budget")
#: The node input's bounds for ``resident_gb`` (GB).
RESIDENT_GB_MIN, RESIDENT_GB_MAX = 0.0, 4096.0


@dataclass(frozen=True)
class OffloadSettings:
    """The node's inputs, by name, and the node whose UI shows the telemetry."""

    blocks_per_group: int = 1
    prefetch: int = 1
    residency: str = "auto"
    resident_gb: float = 0.0
    node_id: str | None = None

    def validate(self) -> None:
        """``ValueError`` naming the input that is out of range (the node's input validation and its run
        both call this)."""
        if self.residency not in RESIDENCY_MODES:
            raise ValueError(f"residency must be one of {', '.join(RESIDENCY_MODES)}, got {self.residency!r}")
        if self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be at least 1, got {self.blocks_per_group}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {self.prefetch}")
        if not (math.isfinite(self.resident_gb) and RESIDENT_GB_MIN <= self.resident_gb <= RESIDENT_GB_MAX):
            raise ValueError(f"resident_gb must be a finite number from {RESIDENT_GB_MIN:g} to {RESIDENT_GB_MAX:g} "
                             f"(GB), got {self.resident_gb}")

    def resident_bytes(self) -> int:
        """``resident_gb`` in bytes: what ``budget`` keeps resident."""
        return int(self.resident_gb * GB)
