"""``bench/gpu_benchmark.py --smoke``: every family and row of the GPU benchmark, on the CPU, in a minute."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.config import BenchConfig, smoke_config
from gpu.families.text_encoder import TEXT_ENCODER_SYSTEMS
from gpu.runner import FAMILIES
from gpu.timing import RowOverTime, StepClock, overlap_figures
from gpu.weights import comfy_qwen_shapes

from testbed.comfy_boot import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "gpu_benchmark.py"  # bench/ is on sys.path (conftest.py)
HOST_BUDGET_SCRIPT = REPO_ROOT / "bench" / "host_budget.py"


def run_smoke(out: Path, families: list[str]) -> dict:
    """``gpu_benchmark.py --smoke`` of ``families`` into ``out``; its results, once each row said it began and
    ended."""
    # The budget and the timeout below pytest's 600 s: on a loaded CI machine the families past 420 s (the default
    # budget) would be skipped.
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--budget-s", "540", "--families", ",".join(families),
                           "--out", str(out)], capture_output=True, text=True, timeout=580,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", BENCH_SCRATCH=str(out / "files")))
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "gpu_results.md").read_text().startswith("no GPU: --smoke")
    results = json.loads((out / "gpu_results.json").read_text())
    assert done.stdout.count('RESULT {"kind": "row"') == done.stdout.count('RESULT {"kind": "start"') \
        == len(results["rows"]), "each row says it began, then its RESULT line as it ends"
    return results


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Every family but the text encoder's (a run of its own below, within pytest's time)."""
    out = tmp_path_factory.mktemp("gpu_smoke")
    return run_smoke(out, [name for name in FAMILIES if name not in TEXT_ENCODER_SYSTEMS]), out


def _rows(results: dict, system: str) -> list[dict]:
    return [r for r in results["rows"] if r["system"] == system]


GGUF_REFUSED = "cannot stream GGUF"  # until the GGUF mechanism lands, the node refuses, and the row says so


def test_every_row_ran(smoke):
    results, _ = smoke
    pack = _rows(results, "this pack")
    assert {(r["family"], r["dtype"], r["mode"]) for r in pack} == {
        *(("pack", "bf16", mode) for mode in (
            "auto", "stream_all p1", "stream_all p2", "stream_all p1, pins refused",
            "stream_all p1, pins capped at 50% (staging ring)",
            "stream_all p1, host budget 25% (in place: ComfyUI's tensors)")),
        ("auto", "bf16", "auto"), ("fp8", "fp8", "auto"), ("fp8", "fp8", "stream_all p1"),
        *((family, "bf16, 1 blocks", mode) for family in ("lora", "lora-native")
          for mode in ("stream_all p1", "stream_all p1 + LoRA")),
        *(("gguf", f"GGUF {q}", mode) for q in ("Q8_0", "Q4_K") for mode in ("auto", "stream_all p2")),
        ("compile-pack-after", "bf16, 2 blocks", "auto, then TorchCompileModel"),
        ("compile-pack-before", "bf16, 2 blocks", "TorchCompileModel, then auto"),
        *(("box", f"{ram} GB RAM", "loader, host_memory auto") for ram in (32, 16))}
    legacy = _rows(results, "ComfyUI legacy")  # newest ComfyUI's own rows run legacy without CUDA
    assert sorted(r["family"] for r in legacy) == sorted(
        ["shipped"] * 2 + ["fp8"] + ["legacy"] * 2 + ["compile-dynamic"] + ["box"] * 2)
    assert len(_rows(results, "ComfyUI-GGUF")) == 3 and len(_rows(results, "ComfyUI TorchCompileModel path")) == 2
    assert {r["dtype"] for r in _rows(results, "all resident")} == {"bf16", "fp8", "GGUF Q8_0", "GGUF Q4_K"}
    for row in results["rows"]:
        if row["system"] != "diffusers" and "staging ring" not in row["mode"]:  # (pins need CUDA)
            if row["family"] == "gguf" and row["skipped"] and GGUF_REFUSED in row["skipped"]:
                continue
            assert row["skipped"] is None and row["seconds"] > 0, row
    assert not [name for name, family in results["families"].items() if "error" in family]


def test_the_users_machine_rows_have_their_figures(smoke):
    results, _ = smoke
    assert results["facts"]["box_file"]["bytes"] > 0
    for row in (r for r in results["rows"] if r["family"] == "box"):
        assert row["load_s"] > 0 and row["second_first_step_s"] > 0 and row["read_bytes"] is not None
        assert "pinned-memory limit" in row["note"] and "page cache" in row["note"]
        assert (row["disk_bytes"] is not None) == (row["system"] == "this pack")


def test_the_text_encoder_family_runs_every_path(tmp_path):
    """The text-encoder family at tiny size, each path in its own process: Dynamic VRAM's skips without CUDA, the
    others load, encode (first, steady, after a prompt change) and give the conditioning ComfyUI gives; the file and
    the conditionings are removed at the end."""
    results = run_smoke(tmp_path, ["text_encoder"])
    rows = {row["family"]: row for row in results["rows"]}
    assert list(rows) == list(TEXT_ENCODER_SYSTEMS)
    assert "needs Dynamic VRAM" in rows.pop("te-dynamic")["skipped"]
    prompts = smoke_config().te_prompts
    for row in rows.values():
        assert row["skipped"] is None, row
        assert row["load_s"] > 0 and row["first_step_s"] > 0 and row["peak_anon_bytes"] > 0
        assert len(row["step_s"]) == len(row["change_s"]) == prompts
        assert row["max_abs_diff"] == 0, "on the CPU every path computes ComfyUI's conditioning"
    assert "the reference" in rows["te-legacy"]["note"]
    assert results["facts"]["te_file"]["bytes"] > 0 and not results["facts"]["te_file"]["full_size"]
    assert "s per prompt change" in (tmp_path / "gpu_results.md").read_text()
    assert not list((tmp_path / "files").glob("qwen25_vl_7b_*")), "the parent removes the file and the conditionings"
    assert not [name for name, family in results["families"].items() if "error" in family]


def test_the_ledgers_read_as_the_engine_promises(smoke):
    results, _ = smoke
    blocks = results["config"]["blocks"]
    for row in (r for r in _rows(results, "this pack") if not r["skipped"]):
        assert row["d2h_bytes"] == 0
        if row["mode"].startswith("stream_all"):
            groups = blocks // 3 if row["family"].startswith("lora") else blocks  # a third of the blocks
            assert row["copies"] == groups * row["calls_per_step"], "one copy per streamed group per call"
            assert row["streamed_bytes"] > 0
    copy_back = _rows(results, "copy-back")[0]
    assert copy_back["d2h_bytes"] == copy_back["streamed_bytes"] > 0


def test_chart_and_trace_are_written(smoke):
    results, out = smoke
    assert results["chart"] and (out / "gpu_results.png").read_bytes().startswith(b"\x89PNG")
    traces = {(t["family"], t["mode"]): t for t in results["traces"]}
    assert set(traces) == {("pack", "stream_all p1"), ("auto", "auto"),
                           ("compile-pack-after", "auto, then TorchCompileModel"),
                           *((family, mode) for family in ("lora", "lora-native")
                             for mode in ("stream_all p1", "stream_all p1 + LoRA"))}
    for trace in traces.values():
        assert "traceEvents" in json.loads(gzip.decompress((out / trace["trace"]).read_bytes()))
    assert len({t["trace"] for t in traces.values()}) == len(traces), "one file per profiled row"


def test_overlap_is_measured_from_the_trace_intervals():
    kernels = [{"cat": "kernel", "ts": 0, "dur": 60}, {"cat": "kernel", "ts": 70, "dur": 30}]
    copies = [{"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 50, "dur": 30},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 0, "dur": 100}]
    figures = overlap_figures(kernels + copies)
    assert figures["span_ms"] == pytest.approx(0.1)
    assert figures["copy_hidden"] == pytest.approx(20 / 30)  # 50-60 and 70-80 under kernels
    assert figures["overlap_of_step"] == pytest.approx(0.2)
    assert figures["gpu_idle_of_step"] == pytest.approx(0.0)


def test_the_checkpoint_has_every_weight_with_dynamic_vram_switched_on(comfy, monkeypatch):
    """Under Dynamic VRAM's switch ComfyUI's Linear layers have no weight until loaded (the first GPU run
    of the benchmark failed here: 'img_in.weight' missing from the checkpoint it made)."""
    memory_management = pytest.importorskip("comfy.memory_management", reason="this ComfyUI has no Dynamic VRAM")
    if not hasattr(memory_management, "aimdo_enabled"):
        pytest.skip("this ComfyUI has no Dynamic VRAM switch")
    config = BenchConfig(blocks=2, heads=2, head_dim=32, joint_dim=64)
    eager = comfy_qwen_shapes(config)
    monkeypatch.setattr(memory_management, "aimdo_enabled", True)
    assert comfy_qwen_shapes(config) == eager
    assert {"img_in.weight", "transformer_blocks.1.attn.to_q.weight"} <= set(eager)
    assert memory_management.aimdo_enabled, "the switch is left as it was"


def test_a_row_stops_past_its_limit_once_a_timed_step_is_in():
    ran = []
    clock = StepClock(torch.device("cpu"), {0: lambda: ran.append(0), 1: lambda: ran.append(1)}, limit_s=0.0)
    clock(0)  # the warm-up is always kept
    with pytest.raises(RowOverTime):
        clock(1)
    assert ran == [0, 1], "the step's callback (a profiler's stop) runs before the row stops"
    assert len(clock.steps) == 2


def test_the_host_budget_benchmark_runs_every_path():
    """``bench/host_budget.py --smoke``: a 4-block model through plain ComfyUI, the loader and the node at a host
    budget of 25 %, warm and cold, each in a fresh process; it prints its section and writes nothing."""
    done = subprocess.run([sys.executable, str(HOST_BUDGET_SCRIPT), "--smoke"], capture_output=True, text=True,
                          timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| ComfyUI |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    rows = [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|"))))
            for line in lines[lines.index(header) + 2:] if line.startswith("| ")]
    assert [(row["path"], row["page cache"]) for row in rows] == [
        (path, cache) for path in ("ComfyUI's Load Diffusion Model", "this pack's loader",
                                   "Load Diffusion Model + Group Offload") for cache in ("warm", "cold (fadvise)")]
    assert all(row["latent = plain"] == "yes" for row in rows)
    cold_loader = rows[3]
    assert float(cold_loader["1st step from disk MB, mincore / read"].split(" / ")[1]) > 0, "the cold step read the file"



def test_the_text_encoder_memory_benchmark_runs_every_way(tmp_path):
    """``bench/text_encoder_memory.py``'s measurement with a 2-layer encoder: every way in a fresh process, the
    conditioning ComfyUI's, and the loader in place holding less anonymous memory than ComfyUI by most of the layers."""
    import text_encoder_memory
    from host_budget import versions

    (version,) = versions(None)
    results = text_encoder_memory.measure(version, tmp_path, text_encoder_memory.SMOKE_LAYERS)
    plain = results["ComfyUI"]
    for way in text_encoder_memory.WAYS:
        assert all(torch.equal(a, b) for a, b in zip(results[way]["conds"], plain["conds"], strict=True)), way
    widths = text_encoder_memory.WIDTHS  # (the feed-forward matrices, bf16: most of the layers' bytes)
    layer_bytes = 3 * widths["hidden_size"] * widths["intermediate_size"] * 2 * text_encoder_memory.SMOKE_LAYERS
    in_place = results["loader, in place"]
    assert in_place["held_anonymous"] - in_place["device_buffers"] < plain["held_anonymous"] - layer_bytes / 2
