"""The pack's modules as ComfyUI loaded them (one copy, shared with the registered nodes)."""
from __future__ import annotations

import sys
from types import ModuleType

from testbed.comfy_boot import boot_comfyui_in_process, pack_dir


def pack_module(dotted: str) -> ModuleType:
    """``pack_module("nodes.memory")``: that module of the custom node ComfyUI loaded."""
    boot_comfyui_in_process()
    suffix = f"{pack_dir().name}.{dotted}"  # the folder name ComfyUI loaded it under
    found = [m for name, m in sys.modules.items() if name.endswith(suffix)]
    if len(found) != 1:
        raise LookupError(f"expected one loaded module ending in {suffix!r}, found {len(found)}")
    return found[0]
