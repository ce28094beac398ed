"""The results of a run: the derived figures, the markdown table, the PNG chart and the JSON file."""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from reporting import fmt, markdown_table

from .config import GIB, BenchConfig, cap_label


def derive(rows: list[dict[str, Any]], bandwidth: dict[str, float]) -> list[dict[str, Any]]:
    """× all resident, GB/s and its share of the pinned peak, step ÷ max(compute, bytes ÷ bandwidth)."""
    resident = {r["dtype"]: statistics.median(r["step_s"]) for r in rows if r["system"] == "all resident" and r["step_s"]}
    pinned = bandwidth.get("h2d_pinned_gbps")
    out = []
    for row in rows:
        seconds = statistics.median(row["step_s"]) if row["step_s"] else None
        compute = resident.get(row["dtype"])
        streamed = row["streamed_bytes"] or 0.0
        derived: dict[str, Any] = {"seconds": seconds, "ratio_to_resident": None, "achieved_gbps": None,
                                   "share_of_pinned_peak": None, "vs_bound": None}
        if seconds is not None:
            derived["ratio_to_resident"] = seconds / compute if compute else None
            if streamed:
                derived["achieved_gbps"] = streamed / seconds / 1e9
                derived["share_of_pinned_peak"] = derived["achieved_gbps"] / pinned if pinned else None
            if compute and pinned:
                derived["vs_bound"] = seconds / max(compute, streamed / (pinned * 1e9))
        out.append({**row, **derived})
    return out


def _gb(value: float | None) -> str:
    return fmt(None if value is None else value / 1e9, 2)


def results_markdown(rows: list[dict[str, Any]], facts: dict[str, Any], traces: list[dict[str, Any]],
                     header: str) -> str:
    bandwidth = facts.get("bandwidth", {})
    bw = ", ".join(f"{k.removesuffix('_gbps').replace('_', ' ')} {v:.1f}" for k, v in bandwidth.items())
    headers = ["system", "mode", "dtype", "cap", "s/step", "× all resident", "first step s (load)", "streamed GB/step",
               "GB/s", "of pinned peak", "step ÷ max(compute, bytes ÷ bw)", "GPU wait ms/step", "copies/step",
               "D2H GB/step", "model calls/step", "resident groups", "pinned GB (pack / ComfyUI)", "peak RSS GB", "note"]
    table = [[r["system"], r["mode"], r["dtype"], cap_label(r["cap_bytes"]), fmt(r["seconds"], 3), fmt(r["ratio_to_resident"]),
              fmt(r["first_step_s"], 1), _gb(r["streamed_bytes"]), fmt(r["achieved_gbps"], 1),
              fmt(None if r["share_of_pinned_peak"] is None else 100 * r["share_of_pinned_peak"], 0) + "%"
              if r["share_of_pinned_peak"] is not None else "—",
              fmt(r["vs_bound"]), fmt(r["compute_wait_ms"], 1), fmt(r["copies"], 0), _gb(r["d2h_bytes"]),
              fmt(r["calls_per_step"], 1), "—" if r["resident_groups"] is None else str(r["resident_groups"]),
              f"{_gb(r['pinned_bytes'])} / {_gb(r['comfy_pinned_bytes'])}", _gb(r["peak_rss_bytes"]),
              r["skipped"] or r["note"]] for r in rows if not is_text_encoder(r)]
    lines = [header, "", f"Bandwidth (GB/s, 1 GiB copies): {bw or 'not measured'}.",
             f"ComfyUI started with: {facts.get('patcher', '?')}; allocator {facts.get('allocator') or 'default'}."]
    for trace in traces:
        if trace.get("gpu_events"):
            lines.append(f"Profiled step ({trace['family']}: {trace['mode']}, cap {cap_label(trace['cap_bytes'])}, `{trace['trace']}`): "
                         f"GPU span {trace['span_ms']:.0f} ms, kernels {trace['kernel_ms']:.0f} ms, "
                         f"host-to-device copies {trace['copy_ms']:.0f} ms; copies and kernels overlapped during "
                         f"{100 * trace['overlap_of_step']:.0f} % of the step ({fmt(trace['copy_hidden'] and 100 * trace['copy_hidden'], 0)} % "
                         f"of the copy time hidden); GPU idle {100 * trace['gpu_idle_of_step']:.0f} % of the step.")
        else:
            lines.append(f"Profiled step ({trace['family']}: {trace['mode']}): `{trace['trace']}` (no GPU events on a CPU).")
    lines += compile_lines(rows) + box_lines(rows, facts) + text_encoder_lines(rows, facts)
    return "\n".join(lines) + ("\n\n" + markdown_table(headers, table) if table else "")


def compile_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The compile family's first step less its steady step: the load and the compile (the eager rows': the load)."""
    parts = [f"{r['system']}, {r['mode']}: {r['first_step_s'] - r['seconds']:.1f} s" for r in rows
             if r["family"].startswith("compile-") and r["seconds"] is not None]
    return [f"Compile (first step less the steady step: load and compile; eager rows: load only): {'; '.join(parts)}."] if parts else []


def box_lines(rows: list[dict[str, Any]], facts: dict[str, Any]) -> list[str]:
    """The user's machine: a table of its own (load, first and second generation, bytes from storage, RSS)."""
    box = [r for r in rows if r["family"] == "box"]
    if not box:
        return []
    written = facts.get("box_file", {})
    headers = ["machine", "card", "system", "load s", "first step s", "s/step", "2nd generation's first step s",
               "read from storage GB/step", "pack: from disk GB/step", "peak RSS GB", "note"]
    table = [[r["dtype"], cap_label(r["cap_bytes"]), f"{r['system']}, {r['mode']}", fmt(r["load_s"], 1),
              fmt(r["first_step_s"], 1), fmt(r["seconds"], 3), fmt(r["second_first_step_s"], 2), _gb(r["read_bytes"]),
              _gb(r["disk_bytes"]), _gb(r["peak_rss_bytes"]), r["skipped"] or r["note"]] for r in box]
    file_line = (f"The user's machine: fp8 file of {written['bytes'] / 1e9:.1f} GB written (fsynced) in "
                 f"{written['write_s']:.0f} s ({written['bytes'] / written['write_s'] / 1e9:.2f} GB/s)." if written
                 else "The user's machine:")
    return ["", file_line, "", markdown_table(headers, table), ""]


def text_encoder_lines(rows: list[dict[str, Any]], facts: dict[str, Any]) -> list[str]:
    """The text encoder's own table (``families/text_encoder.py``): load, first, prompt-change and steady encodes,
    memory, the conditioning's max |Δ| against ComfyUI's."""
    te = [r for r in rows if is_text_encoder(r)]
    if not te:
        return []
    written = facts.get("te_file")
    made = (f" of {written['bytes'] / 1e9:.1f} GB, {written['layers']} layers "
            f"({'full size' if written['full_size'] else 'tiny, --smoke'}), written in {written['write_s']:.0f} s"
            if written else "")
    headers = ["system", "mode", "cap", "load s", "first encode s", "s per prompt change", "steady encode s",
               "peak anonymous GB", "peak RSS GB", "pinned GB (pack / ComfyUI)", "max |Δ| vs ComfyUI", "note"]
    table = [[r["system"], r["mode"], cap_label(r["cap_bytes"]), fmt(r["load_s"], 1), fmt(r["first_step_s"], 2),
              fmt(statistics.median(r["change_s"]) if r["change_s"] else None, 2), fmt(r["seconds"], 2),
              _gb(r["peak_anon_bytes"]), _gb(r["peak_rss_bytes"]), f"{_gb(r['pinned_bytes'])} / {_gb(r['comfy_pinned_bytes'])}",
              "—" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}", r["skipped"] or r["note"]] for r in te]
    return ["", f"The text encoder: a Qwen2.5-VL-7B-shaped bf16 file{made}; a prompt change is an encode after "
            "unload_all_models() (the diffusion model took the card); steady: the encoder left where it was.", "",
            markdown_table(headers, table), ""]


def is_text_encoder(row: dict[str, Any]) -> bool:
    """A row of the text-encoder family: encodes, not sampling steps (its own table, not the chart)."""
    return row["family"].startswith("te-")


def write_chart(rows: list[dict[str, Any]], path: Path) -> bool:
    """A PNG bar chart of s/step per system at each cap (Pillow); False when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return False
    bars = [(f"{r['dtype']} {cap_label(r['cap_bytes'])}  {r['system']}, {r['mode']}", r["seconds"]) for r in rows
            if r["seconds"] and not is_text_encoder(r)]
    if not bars:
        return False
    longest = max(s for _, s in bars)
    label_w, bar_w, line_h = 430, 520, 22
    image = Image.new("RGB", (label_w + bar_w + 90, line_h * len(bars) + 40), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), "seconds per sampling step (shorter is better)", fill="black")
    colours = {"this pack": (46, 125, 50), "all resident": (120, 120, 120)}
    for i, (label, seconds) in enumerate(bars):
        y = 30 + i * line_h
        system = label.split("  ", 1)[1].split(",")[0]
        draw.text((10, y + 4), label[:70], fill="black")
        width = max(1, int(bar_w * seconds / longest))
        draw.rectangle((label_w, y + 3, label_w + width, y + line_h - 3), fill=colours.get(system, (198, 40, 40)))
        draw.text((label_w + width + 6, y + 4), f"{seconds:.3f}", fill="black")
    image.save(path)
    return True


def environment(config: BenchConfig) -> str:
    if config.device.type == "cuda":
        props = torch.cuda.get_device_properties(config.device)
        gpu = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        gpu = "no GPU: --smoke on the CPU (caps are labels, bandwidths are host copies)"
    return (f"{gpu}; torch {torch.__version__}, Python {platform.python_version()}; Qwen-Image {config.blocks} blocks × "
            f"width {config.heads * config.head_dim}, {config.width}×{config.height}, {config.text_tokens} text tokens, "
            f"euler cfg 4, {config.steps} timed steps after 1 warm-up step; {time.strftime('%Y-%m-%d %H:%M')}")


def write_results(config: BenchConfig, families: dict[str, dict[str, Any]], seconds: float, out: Path) -> int:
    facts = {k: v for f in families.values() for k, v in f["facts"].items()}
    rows = derive([r for f in families.values() for r in f["rows"]], facts.get("bandwidth", {}))
    traces = [t for f in families.values() for t in f["traces"]]
    errors = {name: f["error"] for name, f in families.items() if "error" in f}
    header = f"{environment(config)}; {seconds:.0f} s in all." + "".join(
        f"\n\nFamily {name}: {error}" for name, error in errors.items())
    markdown = results_markdown(rows, facts, traces, header)
    chart = write_chart(rows, out / "gpu_results.png")
    (out / "gpu_results.json").write_text(json.dumps(
        {"config": asdict(config), "facts": facts, "families": families, "rows": rows, "traces": traces,
         "seconds": seconds, "chart": chart}, indent=1))
    (out / "gpu_results.md").write_text(markdown + "\n")
    return 1 if errors else 0
