"""How many device bytes the resident groups may use, from ComfyUI's own memory figures."""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1024**3
RESIDENCY_MODES = ("auto", "stream_all", "budget")


@dataclass(frozen=True)
class OffloadSettings:
    """What the user chose on the node; stays with every clone of the patched model."""

    blocks_per_group: int = 1
    prefetch: int = 1
    residency: str = "auto"
    resident_gb: float = 0.0
    node_id: str | None = None  # the node whose UI shows the telemetry

    def validate(self) -> None:
        if self.residency not in RESIDENCY_MODES:
            raise ValueError(f"residency must be one of {', '.join(RESIDENCY_MODES)}, got {self.residency!r}")
        if self.blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be at least 1, got {self.blocks_per_group}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {self.prefetch}")
        if not (math.isfinite(self.resident_gb) and self.resident_gb >= 0):
            raise ValueError(f"resident_gb must be a finite number, 0 or more, got {self.resident_gb}")


def resident_budget(settings: OffloadSettings, weight_budget: float, full_load: bool,
                    other_weight_bytes: int, slab_bytes: int, free_bytes: float) -> int:
    """Device bytes for resident groups.

    ``weight_budget`` is what ComfyUI's ``load_models_gpu`` grants this model's weights after its
    inference reserve for the sampling run (``lowvram_model_memory``); ``full_load`` means ComfyUI
    grants all of it, which it also says under ``--highvram`` / ``--gpu-only`` whatever the model's
    size. ``free_bytes`` is the device memory really free once the rest of the model is loaded,
    less ComfyUI's inference reserve: ``auto`` never plans past it. ``other_weight_bytes`` are the
    weights outside the blocks (always loaded) and ``slab_bytes`` the streaming buffers.
    """
    if settings.residency == "stream_all":
        return 0
    if settings.residency == "budget":
        return int(settings.resident_gb * GB)
    room = free_bytes - slab_bytes
    granted = room if full_load else min(weight_budget - other_weight_bytes - slab_bytes, room)
    return max(0, int(granted))
