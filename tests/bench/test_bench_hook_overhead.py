"""``bench/hook_overhead.py --base``: another checkout's core measured beside this one, in one process."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from testbed.comfy_boot import REPO_ROOT

sys.path.append(str(REPO_ROOT / "bench"))

import hook_overhead  # noqa: E402


def test_base_and_this_core_are_measured_alternately_in_one_process(tmp_path: Path):
    shutil.copytree(REPO_ROOT / "offload_core", tmp_path / "offload_core", ignore=shutil.ignore_patterns("__pycache__"))
    rows = hook_overhead.compare(tmp_path, rounds=1, quick=True)
    assert sys.modules["offload_core_base"].__file__ == str(tmp_path / "offload_core" / "__init__.py")
    narrow = [c.label for c in hook_overhead.default_configs(quick=True) if c.narrow > 1 and not c.quantized]
    assert [row["config"] for row in rows][: len(narrow)] == narrow
    assert all(0 < row[f"{name}_min_us"] <= row[f"{name}_us"] for row in rows for name in ("base", "this"))
    assert "this ÷ base" in hook_overhead.comparison_table(rows)
