"""Whether this ComfyUI can load the pack, checked before any node module imports ComfyUI: by what the pack
uses, not by version strings. A ComfyUI that lacks it, or a second copy of the pack already loaded, gets one
message and no nodes from this copy; ComfyUI goes on starting either way."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

PACK_TITLE = "Group Offload (no copy-back)"
INSTALL_NAME = "group-offload-no-copy-back"  # the Registry id and the folder the Manager and comfy-cli clone into
OLDEST_TESTED = "0.3.75"
# What the nodes import from ComfyUI: module -> names in it.
COMFYUI_USES = {
    "comfy.model_patcher": ("ModelPatcher", "get_key_weight"),
    "comfy.weight_adapter": ("WeightAdapterBase",),
    "comfy.patcher_extension": (),
    "comfy.sampler_helpers": (),
    "comfy.supported_models_base": (),
    "comfy.model_detection": (),
    "comfy.float": (),
}
NODE_NAMES = ("GroupOffload", "GroupOffloadLoader", "GroupOffloadTextEncoder", "GroupOffloadCLIPLoader",
              "GroupOffloadReport")


def _missing_from_comfyui() -> list[str]:
    missing = []
    for module_name, names in COMFYUI_USES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    return missing


def _comfyui_version() -> str:
    try:
        return importlib.import_module("comfyui_version").__version__
    except (ImportError, AttributeError):
        return "of unknown version"


def _other_copy(package: str) -> Path | None:
    """The folder of another package (another copy of the pack) that registered a node of ours first."""
    registered = getattr(sys.modules.get("nodes"), "NODE_CLASS_MAPPINGS", {})
    for name in NODE_NAMES:
        module = sys.modules.get(getattr(registered.get(name), "__module__", ""))
        if module is not None and not module.__name__.startswith(package + "."):
            return Path(module.__file__).parents[1]  # <pack>/nodes/offload_nodes.py
    return None


def _nodes_module_problem() -> str | None:
    """ComfyUI's nodes.py must be the module named ``nodes``: a pack that put its own first shadows it."""
    comfy_nodes = sys.modules.get("nodes")
    location = Path(getattr(comfy_nodes, "__file__", "") or "")
    if comfy_nodes is None or location.name != "nodes.py" or not hasattr(comfy_nodes, "NODE_CLASS_MAPPINGS"):
        return f"the module `nodes` is not ComfyUI's nodes.py but {location or comfy_nodes!r} (another pack shadows it)"
    return None


def load_problem(package: str, folder: Path) -> str | None:
    """Why the pack in ``folder`` (imported as ``package``) should register no nodes here, or None."""
    missing = _missing_from_comfyui()
    if missing:
        return (f"{PACK_TITLE} needs ComfyUI {OLDEST_TESTED} or newer; this ComfyUI ({_comfyui_version()}) lacks "
                f"{', '.join(missing)}. Update ComfyUI; until then the pack's nodes are not loaded.")
    shadowed = _nodes_module_problem()
    if shadowed:
        return f"{PACK_TITLE} cannot load: {shadowed}. Its nodes are not loaded."
    other = _other_copy(package)
    if other:
        return (f"{PACK_TITLE} is installed twice: its nodes are already registered from {other}, so this copy "
                f"in {folder} registers none. Keep one, installed as custom_nodes/{INSTALL_NAME}.")
    return None
