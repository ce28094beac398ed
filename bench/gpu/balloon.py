"""The cap is a balloon: (total − cap) bytes held on the card, so that every allocator and every free-memory
query (ComfyUI's, comfy-aimdo's, the pack's ``auto``) sees a card of ``cap`` bytes."""
from __future__ import annotations

import gc

import torch


class Balloon:
    """Holds (total − cap) bytes of the card so that everyone sees a card of ``cap`` bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: torch.Tensor | None = None

    def set_cap(self, cap: int | None) -> None:
        """Unload every model (ComfyUI loads again at the next run, planning against the new card)."""
        import comfy.model_management as mm

        self._held = None
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache(True)
        if self.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        if cap is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            self._held = torch.empty(max(0, total - cap), dtype=torch.uint8, device=self.device)
