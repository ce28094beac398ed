"""The CPU benchmark's report: its tables, the issue's targets checked against the figures, and the "CPU" section
of BENCHMARKS.md that ``bench/cpu_benchmark.py`` writes from them."""
from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

import hook_overhead
from reporting import fmt, markdown_table


def _mb(value: float | None) -> str:
    return fmt(None if value is None else value / 1e6, 1)


def modes_table(results: dict[str, dict[str, Any]]) -> str:
    headers = ["model", "mode", "s/step", "× plain", "cost model × plain", "MB h2d/step", "MB d2h/step",
               "copies h2d / d2h per step", "streamed groups", "hook µs/group", "peak RSS ÷ model, sampling (host side)"]
    rows = []
    for case_name, result in results.items():
        label = result["label"]
        for r in result["rows"]:
            copies = "—" if r["copies_h2d_per_step"] is None else f"{r['copies_h2d_per_step']:.0f} / {r['copies_d2h_per_step']:.0f}"
            streamed = "—" if r["streamed_groups"] is None else f"{r['streamed_groups']} of {r['groups']}"
            rss = f"{fmt(r['peak_rss_ratio'])} ({fmt(r['host_rss_ratio'])})" if case_name == "full_width" else "n/m"
            rows.append([label, r["label"], fmt(r["step_s"], 3), fmt(r["ratio"]), fmt(r["model_ratio"]),
                         _mb(r["h2d_per_step"]), _mb(r["d2h_per_step"]), copies, streamed,
                         fmt(r["hook_us_per_group"], 0 if case_name == "full_width" else 1), rss])
    return markdown_table(headers, rows)


def loading_table(results: dict[str, dict[str, Any]]) -> str:
    headers = ["model", "loader", "model GB in memory", "one group GB", "load s", "peak RSS while loading ÷ model",
               "peak − model GB", "RSS after loading ÷ model", "peak RSS while sampling ÷ model (host side)"]
    rows = []
    for case_name, result in results.items():
        group_gb = fmt(result["timing"]["group_bytes"] / 1e9, 3)
        for load in result["loads"]:
            size = load["model_bytes"]
            sampling = load.get("sampling_peak_rss")
            cells = [fmt(load["peak_rss"] / size), fmt((load["peak_rss"] - size) / 1e9), fmt(load["after_rss"] / size),
                     "—" if sampling is None else
                     f"{fmt(sampling / size)} ({fmt((sampling - load['sampling_device_side_bytes']) / size)})"]
            if case_name != "full_width":
                cells = ["n/m"] * len(cells)
            rows.append([result["label"], load["loader"], fmt(size / 1e9, 3), group_gb, fmt(load["seconds"], 1), *cells])
    return markdown_table(headers, rows)


def target_lines(results: dict[str, dict[str, Any]], micro: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each checked against what was measured."""
    full = results.get("full_width")
    pack_rows = [r for res in results.values() for r in res["rows"] if r["mode"] not in ("plain", "copy_back")]
    narrow = [m for m in micro if m["group_bytes"] < 2**20]
    lines = []
    if narrow:
        worst = max(m["hook_us"] for m in narrow)
        lines.append(f"hook overhead ≤ 50 µs per group (microbenchmark, narrow Qwen-like groups, worst configuration): "
                     f"{worst:.0f} µs — {'met' if worst <= 50 else 'NOT met'}")
    if full is not None:
        loader = next((l for l in full["loads"] if l["loader"] == "GroupOffloadLoader"), None)
        if loader is not None:
            size, excess = loader["model_bytes"], loader["peak_rss"] - loader["model_bytes"]
            ratio, groups = loader["peak_rss"] / size, excess / full["timing"]["group_bytes"]
            at_60 = 1 + excess / (60 * full["timing"]["group_bytes"])
            lines.append(f"peak host RSS while loading ≤ 1.15 × model (GroupOffloadLoader, full width, "
                         f"{full['timing']['blocks']} blocks): {ratio:.2f} × — {'met' if ratio <= 1.15 else 'NOT met'}; "
                         f"the excess is {groups:.2f} groups, which for Qwen-Image's 60 blocks would be {at_60:.3f} × "
                         "(an extrapolation, not a measurement)")
    if pack_rows:
        d2h = max(r["d2h_per_step"] or 0 for r in pack_rows)
        lines.append(f"device-to-host bytes per step = 0 (every pack mode): max {d2h:.0f} B — {'met' if d2h == 0 else 'NOT met'}")
        extra = [r for r in pack_rows if r["copies_h2d_per_step"] != r["streamed_groups"]]
        lines.append("one copy per streamed group: " + ("met in every pack mode" if not extra else
                     "NOT met in " + ", ".join(f"{r['label']} ({r['copies_h2d_per_step']:.1f} copies, "
                                               f"{r['streamed_groups']} streamed)" for r in extra)))
    return lines


def machine_description() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB RAM, no GPU; Python {platform.python_version()}, "
            f"torch {torch.__version__}; load average {load:.1f} when the benchmark ended")


def _bandwidths(results: dict[str, dict[str, Any]]) -> str:
    return "; ".join(f"{r['label']}: {r['timing']['bandwidth']['existing_gbps']:.2f} GB/s into existing memory, "
                     f"{r['timing']['bandwidth']['fresh_gbps']:.2f} GB/s into fresh memory" for r in results.values())


def cpu_section(results: dict[str, dict[str, Any]], micro: list[dict[str, Any]], profile: str | None,
                command: str, seconds: float, cfg: float) -> str:
    cases = "; ".join(f"{r['label']}: {r['case']['size']}×{r['case']['size']} px, {r['case']['text_tokens']} text "
                      f"tokens, {r['case']['steps']} steps, {r['case']['rounds']} rounds" for r in results.values())
    batches = sorted({row["batch"] for r in results.values() for row in r["rows"] if row["batch"]})
    parts = [
        f"Measured on {machine_description()}. Command: `{command}`, {datetime.date.today().isoformat()}, "
        f"{seconds / 60:.1f} min. ComfyUI runs with `--cpu`, so the \"device\" is the host: every copy is "
        "host-to-host and nothing here measures a GPU.",
        f"Through ComfyUI's KSampler in-process (euler, CFG {cfg:g}; cond and uncond batched: batch "
        f"{'/'.join(map(str, batches))} per model call, one call per step). {cases}. ComfyUI keeps the bf16 file's "
        "weights in float32 on the CPU. Figures per step are over the steps after the first; `× plain` is the "
        "median over a mode's runs of (its step ÷ the mean of the plain runs just before and after it: plain "
        "runs between every two modes); the copy-back baseline ran in the first round only. `cost model × plain` is "
        "`pass_seconds` of `bench/cost_model.py` with plain's step time as compute and the copy rates measured in "
        f"the same process ({_bandwidths(results)}), without overlap (a CPU copy does not overlap).",
        modes_table(results),
        "Peak RSS is net of the process's RSS before the model was loaded (ComfyUI and torch), ÷ the model's "
        "bytes in memory; for the tiny model that process overhead dwarfs the model, so it is not meaningful "
        "(n/m). On a CPU the \"device\" buffers (the pack's streaming slabs and resident copies, the block the "
        "copy-back has onloaded) are host memory too; in brackets, the peak without them: what a GPU run would "
        "hold in host RAM. The pack's sampling peak includes building its mirrors from the UNETLoader model (the "
        "GroupOffload node path); the loader table below has the GroupOffloadLoader path.",
        "### Loading",
        loading_table(results),
        "### Hook overhead (plain torch model, `bench/hook_overhead.py`)",
        "60 blocks with the 32 tensors of a Qwen-Image block at 1/128 of the width (copies of a few µs), and "
        "two full-width blocks; one intra-op thread (see the script's docstring). Medians over the forwards "
        "after the first.",
        hook_overhead.results_table(micro),
        "### Targets",
        "\n".join(f"- {line}" for line in target_lines(results, micro)),
    ]
    if profile:
        parts += ["Where the hook time goes (cProfile, narrow model, stream_all, prefetch 1; the profiler inflates "
                  "absolute times):", f"```\n{profile}\n```"]
    return "\n\n".join(parts)
