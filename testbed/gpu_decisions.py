"""ComfyUI taking, on the CPU, the decisions it takes on a named CUDA card; the tensors stay on the CPU.

ComfyUI decides by the device it runs on: the model's dtype and whether it casts by hand
(``unet_dtype``, ``unet_manual_cast``, ``should_use_fp16`` / ``bf16``), the dtype LoRA is computed in
(``lora_compute_dtype``), what it casts to and whether copies are non-blocking (``supports_cast``,
``device_supports_non_blocking``), whether fp8 is computed as fp8. Under ``--cpu`` every answer is the
CPU's (float32 throughout), so a suite run on the CPU never sees the answers a user's GPU gives.

:func:`install` makes each of those ComfyUI functions answer, for the CPU device (or none), what it
answers for ``cuda:0`` on the card: the function is ComfyUI's own, run with that device, ComfyUI's CPU
state switched to the GPU's for the call, and torch's CUDA queries answering with the card's properties
(name, compute capability, memory). Nothing is a table of answers: a newer ComfyUI's own rules apply.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1 << 30
#: the environment variable that makes the whole suite run as a card decides (see conftest)
CARD_VARIABLE = "GROUP_OFFLOAD_CARD"


@dataclass(frozen=True)
class Card:
    """What torch's ``get_device_properties`` says of a card, as far as ComfyUI reads it."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int = 82


CARDS = {
    "ampere-24g": Card("NVIDIA GeForce RTX 3090", 8, 6, 24 * GIB),  # fp16 and bf16
    "turing-11g": Card("NVIDIA GeForce RTX 2080 Ti", 7, 5, 11 * GIB, 68),  # fp16 only
}

#: ComfyUI's functions whose answer depends on the device (the ones a version lacks are left out)
DECISIONS = ("should_use_fp16", "should_use_bf16", "supports_fp8_compute", "unet_dtype", "unet_manual_cast",
             "lora_compute_dtype", "supports_cast", "device_supports_non_blocking", "maximum_vram_for_weights")
_DEVICE_ARGUMENTS = ("device", "inference_device", "dev")
_CUDA = torch.device("cuda", 0)


def install(card: Card, setattr_: Callable[[Any, str, Any], None]) -> None:
    """Have ComfyUI decide as on ``card`` (``setattr_``: pytest's ``monkeypatch.setattr``, undone after a test)."""
    import comfy.model_management as mm

    as_card = _AsCard(mm, card)
    for name in DECISIONS:
        if hasattr(mm, name):
            setattr_(mm, name, as_card.deciding(getattr(mm, name)))
    if hasattr(mm, "LORA_COMPUTE_DTYPES"):  # its answers are cached per device
        setattr_(mm, "LORA_COMPUTE_DTYPES", {})


class _AsCard:
    """Runs a ComfyUI decision for ``cuda:0`` on ``card`` where it was asked for the CPU."""

    def __init__(self, mm: Any, card: Card) -> None:
        self.mm, self.card = mm, card
        self.depth = 0  # decisions call decisions: the state is switched once, by the outermost

    def deciding(self, decide: Callable) -> Callable:
        signature = inspect.signature(decide)

        @functools.wraps(decide)
        def as_on_the_card(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for name in _DEVICE_ARGUMENTS:
                device = bound.arguments.get(name, _CUDA)
                if name in bound.arguments and (device is None or torch.device(device).type == "cpu"):
                    bound.arguments[name] = _CUDA
            with self._switched():
                return decide(*bound.args, **bound.kwargs)

        return as_on_the_card

    @contextlib.contextmanager
    def _switched(self) -> Iterator[None]:
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        mm, card = self.mm, self.card
        saved = (mm.cpu_state, torch.cuda.get_device_properties, torch.cuda.get_device_capability,
                 torch.cuda.is_bf16_supported, mm.get_total_memory)
        total_memory = saved[4]
        mm.cpu_state = mm.CPUState.GPU
        torch.cuda.get_device_properties = lambda device=None: card
        torch.cuda.get_device_capability = lambda device=None: (card.major, card.minor)
        torch.cuda.is_bf16_supported = lambda *args, **kwargs: card.major >= 8
        mm.get_total_memory = lambda dev=None, torch_total_too=False: (
            total_memory(dev, torch_total_too) if dev is not None and torch.device(dev).type == "cpu"
            else (card.total_memory, card.total_memory) if torch_total_too else card.total_memory)
        self.depth = 1
        try:
            yield
        finally:
            self.depth = 0
            (mm.cpu_state, torch.cuda.get_device_properties, torch.cuda.get_device_capability,
             torch.cuda.is_bf16_supported, mm.get_total_memory) = saved
