"""Puts the repository root on ``sys.path`` for the benchmarks, once: the pure-torch core (``offload_core``) and
the test bed (``testbed``: ComfyUI's boot, the fixture models, the live server) import from there. Each script does
``import bench_paths`` before importing from either.

Appended, not put first: ComfyUI's checkout must come before the repository root, whose ``nodes/``
package would otherwise shadow ComfyUI's ``nodes.py`` (see ``testbed.comfy_boot.prepare_comfy_import``).
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
