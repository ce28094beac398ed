"""Puts the test harness (``tests/``) and the repository root (``offload_core``, ``nodes``) on ``sys.path``
for the benchmarks, once: each script does ``import bench_paths`` before importing from either.

Appended, not put first: ComfyUI's checkout must come before the repository root, whose ``nodes/``
package would otherwise shadow ComfyUI's ``nodes.py`` (see ``comfy_boot.prepare_comfy_import``).
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TESTS_DIR = REPO_ROOT / "tests"

for _folder in (str(TESTS_DIR), str(REPO_ROOT)):
    if _folder not in sys.path:
        sys.path.append(_folder)
