"""The ComfyUI side of the pack: the only code that imports ComfyUI."""
import logging
from pathlib import Path

from .comfyui_check import load_problem

_PACK_DIR = Path(__file__).parent.parent  # as ComfyUI found it in custom_nodes/
_problem = load_problem(__name__.rpartition(".")[0], _PACK_DIR)
if _problem:
    logging.getLogger(__name__).error(_problem)
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
else:
    from .offload_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
