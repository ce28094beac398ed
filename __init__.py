"""Group Offload (no copy-back): what ComfyUI imports from this pack.

Outside ComfyUI (``offload_core`` used on its own) there is nothing to register.
"""
try:
    import comfy.utils  # noqa: F401  (present only inside ComfyUI)
except ImportError:
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
