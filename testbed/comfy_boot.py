"""Booting ComfyUI in this process: where things are, ``import comfy`` / ``import nodes`` made to resolve
to the ComfyUI checkout in use, its version, and :func:`boot_comfyui_in_process`.

Importable from tests and from ``bench/`` scripts (``bench/bench_paths.py`` puts this folder on
``sys.path``). Importing it does not import ComfyUI; :func:`boot_comfyui_in_process` does.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTBED_DIR = REPO_ROOT / "testbed"
TESTNODES_DIR = TESTBED_DIR / "comfy_testnodes"
ARTIFACTS_DIR = REPO_ROOT / ".artifacts"
EMBEDDED_COMFYUI = REPO_ROOT / ".comfyui"

PACK_DIR_NAME = "group-offload-no-copy-back"  # as dev.py links it and users install it
TESTNODES_DIR_NAME = f"{PACK_DIR_NAME}-testnodes"


def comfyui_path() -> Path:
    """The ComfyUI checkout in use: ``$COMFYUI_PATH``, else the embedded ``.comfyui`` of this repo."""
    configured = os.environ.get("COMFYUI_PATH")
    return Path(configured).resolve() if configured else EMBEDDED_COMFYUI.resolve()


def comfyui_version() -> str:
    """The version the ComfyUI checkout in use declares (``comfyui_version.py``), or "unknown"."""
    version_file = comfyui_path() / "comfyui_version.py"
    match = version_file.is_file() and re.search(r'__version__\s*=\s*"([^"]+)"', version_file.read_text())
    return match.group(1) if match else "unknown"


def default_cpu() -> bool:
    """Run ComfyUI with ``--cpu`` unless torch sees a CUDA device."""
    return not torch.cuda.is_available()


def prepare_comfy_import(cpu: bool | None = None) -> None:
    """Make ``import comfy`` and ``import nodes`` resolve to ComfyUI and set its CLI flags.

    ComfyUI only parses ``sys.argv`` when ``comfy.options.enable_args_parsing()`` was called (main.py
    does); in-process it parses ``[]``, so the flags are set on ``comfy.cli_args.args`` directly,
    before ``comfy.model_management`` reads them at import.
    """
    root = comfyui_path()
    if not (root / "comfy" / "model_management.py").is_file():
        raise FileNotFoundError(f"No ComfyUI checkout at {root} (set COMFYUI_PATH or run `python3 dev.py setup`)")
    # First on sys.path (before '' or the repository): this pack has a `nodes/` package that must
    # not shadow ComfyUI's nodes.py. Once nodes.py is imported the order no longer matters.
    if "nodes" not in sys.modules and sys.path[:1] != [str(root)]:
        if str(root) in sys.path:
            sys.path.remove(str(root))
        sys.path.insert(0, str(root))
    import comfy.cli_args

    want_cpu = default_cpu() if cpu is None else cpu
    if "comfy.model_management" in sys.modules:
        if comfy.cli_args.args.cpu != want_cpu:
            logger.warning("comfy.model_management was imported with cpu=%s; cannot switch to %s",
                           comfy.cli_args.args.cpu, want_cpu)
        return
    comfy.cli_args.args.cpu = want_cpu


def _check_comfy_nodes_module(nodes_module: ModuleType) -> None:
    location = Path(getattr(nodes_module, "__file__", "") or "").resolve()
    if location.parent != comfyui_path():
        raise RuntimeError(f"`import nodes` found {location}, not ComfyUI's nodes.py in {comfyui_path()}: "
                           "something put this repository before ComfyUI on sys.path")


def run_maybe_async(result: Any) -> Any:
    return asyncio.run(result) if inspect.isawaitable(result) else result


def _load_custom_node(nodes_module: ModuleType, module_dir: Path) -> bool:
    """Load a node pack exactly as ComfyUI's startup does (``nodes.load_custom_node``)."""
    return bool(run_maybe_async(nodes_module.load_custom_node(str(module_dir), module_parent="custom_nodes")))


def pack_dir() -> Path:
    """The pack as ComfyUI sees it: the custom_nodes link dev.py made, else the repository itself."""
    link = comfyui_path() / "custom_nodes" / PACK_DIR_NAME
    if link.exists() and link.resolve() == REPO_ROOT:
        return link
    return REPO_ROOT


_booted_nodes: ModuleType | None = None


def boot_comfyui_in_process(cpu: bool | None = None) -> ModuleType:
    """Import ComfyUI into this process with its built-in extra nodes, the test nodes and this pack.

    Idempotent. ``cpu=None`` means ``--cpu`` unless CUDA is available. API nodes and other custom
    nodes are not loaded. This pack is loaded only when its root ``__init__.py`` exists; a pack that
    fails to import is logged (as ComfyUI does), not raised. Returns ComfyUI's ``nodes`` module.
    """
    global _booted_nodes
    if _booted_nodes is not None:
        return _booted_nodes
    prepare_comfy_import(cpu)
    import comfy.model_management  # noqa: F401  (reads the CLI flags set above)
    # As in main.py: ComfyUI's `utils` package must be imported before nodes.py puts comfy/ first on
    # sys.path, or `utils` resolves to comfy/utils.py and comfy_extras/nodes_images.py fails to import.
    import utils.extra_config  # noqa: F401
    import nodes

    _check_comfy_nodes_module(nodes)
    init = nodes.init_extra_nodes
    parameters = inspect.signature(init).parameters
    flags = {name: False for name in ("init_custom_nodes", "init_api_nodes") if name in parameters}
    run_maybe_async(init(**flags))

    if not _load_custom_node(nodes, TESTNODES_DIR):
        raise RuntimeError(f"ComfyUI could not load the test nodes in {TESTNODES_DIR}; see the log above")
    if (REPO_ROOT / "__init__.py").is_file() and not _load_custom_node(nodes, pack_dir()):
        logger.error("ComfyUI could not load this pack from %s; its nodes are missing", pack_dir())
    _booted_nodes = nodes
    return nodes
