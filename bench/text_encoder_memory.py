"""The text encoder's host memory and encode time, with and without the pack (CPU, issue 46).

A Qwen2.5-VL-7B-shaped text encoder (ComfyUI's own ``Qwen25_7BVLI``, the real vocabulary, 256 wide with 65,536-wide
feed-forward layers, 8 layers: 0.88 GB in bf16, the layers 91 % of it, as in the real one), each way in a fresh
process, two prompts encoded:

- *ComfyUI*: Load CLIP, as ComfyUI loads it (the whole encoder copied into anonymous memory);
- *node*: Load CLIP → Group Offload (text encoder), ``stream_all``: the layers packed into host mirrors;
- *loader, packed*: Load CLIP (Group Offload), ``stream_all``: the layers packed straight from the file;
- *loader, in place*: the same, ``host_gb = 0``: the layers stay in the file's pages (page cache, not anonymous).

Per way: the process's peak anonymous memory above what it had before loading (``RssAnon``, sampled every 2 ms),
the anonymous memory it holds after the encodes, and of that the streaming buffers and resident groups (on a GPU,
device memory; on the CPU they are host memory, so they are subtracted for what a GPU machine's RAM would hold),
and the second encode's seconds against ComfyUI's (a ratio, one run). The conditioning is checked bit-identical to
ComfyUI's.

    .venv/bin/python bench/text_encoder_memory.py --versions 0.3.75,0.33.0  # writes its section of BENCHMARKS.md
    .venv/bin/python bench/text_encoder_memory.py --smoke                   # 2 layers; prints it only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path: testbed)
from host_budget import MB, machine, versions
from reporting import fmt, markdown_table, replace_section
from testbed.host_memory import PeakAnonymous, rss_anon_bytes

HEADING = "Text encoder: host memory and encode time with and without the pack (CPU, issue 46)"
WIDTHS = {"hidden_size": 256, "intermediate_size": 65536, "num_attention_heads": 2, "num_key_value_heads": 1}
LAYERS, SMOKE_LAYERS = 8, 2
PROMPTS = ("a photograph of a cat on a windowsill, morning light", "a lighthouse at dusk, long shadows over the sea")
STREAM_ALL = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
WAYS = {
    "ComfyUI": ("CLIPLoader", None, {}),
    "node": ("CLIPLoader", "GroupOffloadTextEncoder", STREAM_ALL),
    "loader, packed": ("GroupOffloadCLIPLoader", None, STREAM_ALL),
    "loader, in place": ("GroupOffloadCLIPLoader", None, {**STREAM_ALL, "host_memory": "budget", "host_gb": 0.0}),
}
RESULTS_PREFIX = "TEXT_ENCODER_MEMORY "


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One way, in this (fresh) process: load, encode both prompts; memory, time and the conditioning."""
    from testbed import text_encoders
    from testbed.comfy_boot import boot_comfyui_in_process
    from testbed.pack_modules import pack_module
    from testbed.run_nodes import node_output

    boot_comfyui_in_process()
    text_encoders.use_text_encoders_in_process(Path(spec["models"]))  # (the folder; links the small ones too)
    loader, node, options = WAYS[spec["way"]]
    before = rss_anon_bytes()
    with PeakAnonymous() as peak:
        inputs = {"clip_name": spec["file"], "type": "qwen_image", **(options if node is None else {})}
        clip = node_output(loader, **inputs)
        if node is not None:
            clip = node_output(node, clip=clip, **options)
        seconds, conds = [], []
        for text in PROMPTS:
            started = time.perf_counter()
            ((cond, _),) = node_output("CLIPTextEncode", clip=clip, text=text)
            seconds.append(time.perf_counter() - started)
            conds.append(cond)
    torch.save(conds, spec["conds"])
    handle = pack_module("nodes.model_state").state_of(clip.patcher.model).handle
    buffers = 0 if handle is None else handle().device_bytes_needed()  # (on a GPU: device memory)
    return {"peak_anonymous": peak.peak - before, "held_anonymous": rss_anon_bytes() - before,
            "device_buffers": buffers, "encode_seconds": seconds[-1]}


def run_way(version, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, COMFYUI_PATH=str(version.comfyui))
    done = subprocess.run([version.python, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULTS_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['way']} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULTS_PREFIX))


def text_encoder_file(layers: int, models: Path) -> Path:
    """The benchmark's text encoder of ``layers`` layers (made once, cached), linked into ``models/text_encoders``."""
    from testbed import text_encoders
    from testbed.fixture_models import link_or_copy

    source = text_encoders.cached_fixture("bench_te_qwen25_7b", text_encoders.make_text_encoder,
                                          encoder="qwen25_7b", num_layers=layers,
                                          widths={**text_encoders.ENCODERS["qwen25_7b"].tiny, **WIDTHS})
    link_or_copy(source, models / "text_encoders" / source.name)
    return source


def measure(version, folder: Path, layers: int) -> dict[str, dict[str, Any]]:
    source = text_encoder_file(layers, folder / "models")
    results = {}
    for way in WAYS:
        spec = {"way": way, "file": source.name, "models": str(folder / "models"),
                "conds": str(folder / f"{version.name}-{way}.pt")}
        results[way] = run_way(version, spec)
        results[way]["conds"] = torch.load(spec["conds"])
    results["file_bytes"] = source.stat().st_size
    return results


def table(measured: dict[str, dict[str, Any]]) -> str:
    rows = []
    for version, results in measured.items():
        plain = results["ComfyUI"]
        for way in WAYS:
            r = results[way]
            same = all(torch.equal(a, b) for a, b in zip(r["conds"], plain["conds"], strict=True))
            host = r["held_anonymous"] - r["device_buffers"]
            rows.append([version, way, f"{r['peak_anonymous'] / MB:.0f}", f"{r['held_anonymous'] / MB:.0f}",
                         f"{r['device_buffers'] / MB:.0f}", f"**{host / MB:.0f}**",
                         fmt(r["encode_seconds"] / plain["encode_seconds"]), "yes" if same else "**no**"])
    return markdown_table(["ComfyUI", "way", "peak anonymous MB", "held after the encodes MB",
                           "of it the streaming buffers MB", "held less those MB", "encode time ÷ ComfyUI's",
                           "conditioning identical"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", help="ComfyUI versions of dev.py (default: the one in use)")
    parser.add_argument("--smoke", action="store_true", help="2 layers; print only")
    parser.add_argument("--dry-run", action="store_true", help="print the section, do not write BENCHMARKS.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULTS_PREFIX + json.dumps(child(json.loads(args.child))), flush=True)
        return
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    measured = {}
    with tempfile.TemporaryDirectory(prefix="te-memory-") as folder:
        for version in versions(args.versions):
            measured[version.name] = measure(version, Path(folder) / version.name, layers)
    file_mb = next(iter(measured.values()))["file_bytes"] / MB
    body = (f"`bench/text_encoder_memory.py`: a Qwen2.5-VL-7B-shaped text encoder of {file_mb:.0f} MB (bf16, "
            f"{layers} layers, ComfyUI's own class), each way in a fresh process, two prompts. {machine()}.\n\n"
            f"{table(measured)}\n")
    print(body)
    if not (args.smoke or args.dry_run):
        replace_section(HEADING, body)


if __name__ == "__main__":
    main()
