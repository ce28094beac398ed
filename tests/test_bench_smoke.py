"""``bench/gpu_benchmark.py --smoke``: every code path of the GPU benchmark, on the CPU, in seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_benchmark.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_smoke")
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "gpu_results.md").read_text().startswith("no GPU: --smoke")
    return json.loads((out / "gpu_results.json").read_text())


def _rows(smoke: dict, family: str) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for row in smoke["rows"]:
        if row["family"] == family:
            rows.setdefault(row["mode"], []).append(row)
    return rows


def test_every_pack_mode_ran(smoke):
    rows = _rows(smoke, "pack")
    assert set(rows) == {"p0", "p1", "auto", "resident", "copy_back"}
    for mode_rows in rows.values():
        for row in mode_rows:
            assert row["skipped"] is None and row["seconds"] > 0 and row["model_s"] > 0
    assert len(rows["p0"]) == len(rows["p1"]) == len(rows["auto"]) == 2  # one per cap


def test_the_ledgers_read_as_the_engine_promises(smoke):
    rows = _rows(smoke, "pack")
    blocks = smoke["config"]["blocks"]
    for row in rows["p0"] + rows["p1"]:
        assert row["d2h_bytes"] == 0 and row["copies"] == blocks  # one copy per streamed group
    big_cap, small_cap = rows["auto"]
    assert big_cap["resident_groups"] > small_cap["resident_groups"] >= 0
    assert big_cap["streamed_bytes"] < rows["p1"][0]["streamed_bytes"]
    copy_back = rows["copy_back"][0]
    assert copy_back["d2h_bytes"] == copy_back["streamed_bytes"] > 0


def test_comfy_partial_load_and_diffusers_are_reported(smoke):
    comfy = _rows(smoke, "comfy")["partial"]
    assert [r["skipped"] for r in comfy] == [None, None]
    assert comfy[0]["streamed_bytes"] > comfy[1]["streamed_bytes"]  # the smaller cap streams more
    diffusers = [r for rows in _rows(smoke, "diffusers").values() for r in rows]
    assert len(diffusers) == 2
    for row in diffusers:
        assert row["skipped"] or row["seconds"] > 0
