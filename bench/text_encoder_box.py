"""A Qwen-Image workflow in a box, with and without the pack's text encoder (CPU, issue 46 item 6).

The 887 MB bf16 Qwen2.5-VL-7B-shaped text encoder of ``bench/text_encoder_memory.py`` and the 458 MB float32
Qwen-Image-shaped DiT of ``bench/host_budget.py`` (its text width the encoder's), in one fresh process per row
(``testbed/host_budget_driver.py``, ``text_encoder``): load the text encoder, encode prompt A, load the DiT with
Load Diffusion Model (Group Offload), sample, encode prompt B, sample again (cfg 1: one model call a step). The
process enters a *box* (a memory cgroup v1, ``bench/host_budget_box.py``) before loading, as in a container; the
page cache of both files is evicted before it starts.

The box's limit: the anonymous memory the plain-CLIP workflow adds while it samples (a calibration run outside the
box, nothing packed: what ``auto`` packs in the box) plus half the DiT file. Rows:

1. ComfyUI's Load CLIP (the text encoder in anonymous memory) + the DiT loader at ``host_memory = auto``;
2. Load CLIP (Group Offload) at ``auto`` (in the box it packs nothing: the encoder streams from its file's pages)
   + the DiT loader at ``auto``;
3. ComfyUI's Load CLIP + the DiT loader at ``budget``, ``host_gb`` the DiT file's size;
4. Load CLIP (Group Offload) and the DiT loader, both at that ``budget``: the text encoder packs first, the DiT
   takes its packed copies (those layers stream from the text encoder's file from then on).

Each row's conditionings and latents are compared with plain ComfyUI's (Load CLIP + Load Diffusion Model) outside
the box.

    .venv/bin/python bench/text_encoder_box.py --versions 0.3.75,0.33.0  # writes its section of BENCHMARKS.md
    .venv/bin/python bench/text_encoder_box.py --smoke                   # tiny files, 4 steps; prints it only
"""
from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import bench_paths  # noqa: F401  (puts the repository root on sys.path: testbed)
from host_budget import SMOKE_MODEL, MB, machine, versions
from host_budget_box import box
from reporting import fmt, markdown_table, publish, section_arguments
from text_encoder_memory import LAYERS, PROMPTS, WIDTHS, text_encoder_file
from testbed import text_encoders
from testbed.fixture_models import ModelDir, link_or_copy, tiny_qwen_image_file
from testbed.host_budget_driver import GiB, MODEL, UNET_NAME, evict_page_cache, run_in_fresh_process

log = logging.getLogger("text_encoder_box")

HEADING = "A Qwen-Image workflow in a box, with and without the pack's text encoder (CPU, issue 46)"
STEPS, SMOKE_STEPS = 6, 4  # per sampling; the figures are its steps from the third on
# A tiny model's box is mostly anonymous memory, which a run's peak may exceed by a few MB (no swap: killed).
SMOKE_ANON_MARGIN = 64 * MB
PLAIN_CLIP, OUR_CLIP = "CLIPLoader", "GroupOffloadCLIPLoader"
#: Each row: the text encoder's loader, whether the host memory is ``budget`` (else ``auto``) for both models.
ROWS = {"1. Load CLIP + DiT loader, auto": (PLAIN_CLIP, False),
        "2. Load CLIP (Group Offload) auto + DiT loader auto": (OUR_CLIP, False),
        "3. Load CLIP + DiT loader, budget": (PLAIN_CLIP, True),
        "4. Load CLIP (Group Offload) + DiT loader, one budget": (OUR_CLIP, True)}
RUN_TIMEOUT_S = 900


def files(folder: Path, smoke: bool) -> tuple[ModelDir, str]:
    """A ComfyUI base folder with the DiT (``UNET_NAME``, its text width the encoder's) and the text encoder; the
    text encoder's file name."""
    if smoke:
        encoder, width, dit = text_encoders.text_encoder_file("qwen25_7b"), text_encoders.TEXT_ENCODER_FAMILIES[
            "qwen_image"].width, SMOKE_MODEL
    else:
        encoder, width, dit = text_encoder_file(LAYERS, folder / "models"), WIDTHS["hidden_size"], MODEL
    link_or_copy(encoder, folder / "models" / "text_encoders" / encoder.name)
    link_or_copy(tiny_qwen_image_file(**dit, joint_attention_dim=width),
                 folder / "models" / "diffusion_models" / UNET_NAME)
    return ModelDir(folder), encoder.name


def spec(models: ModelDir, clip_name: str, clip_node: str, via: str, host: dict[str, Any], steps: int,
         out: str) -> dict[str, Any]:
    """The driver's spec for the workflow: ``host`` the host-memory inputs of both loaders; its outputs at ``out``
    (a path less its suffixes)."""
    return {"models": str(models.base_dir), "unet_name": UNET_NAME, "via": via, "steps": steps,
            "offload": host, "latent": f"{out}.latents.pt",
            "text_encoder": {"node": clip_node, "clip_name": clip_name, "offload": host, "prompts": list(PROMPTS),
                             "conds": f"{out}.conds.pt"}}


def run(run_spec: dict[str, Any], version, evicted: list[Path], limit: int | None = None,
        boxed: bool = True) -> dict[str, Any]:
    """The workflow in a fresh process, the files' pages evicted first, in a box of ``limit`` (None: unlimited)
    unless not ``boxed``; ``{"killed": True}`` with the box's peak where the box's OOM killer ended it."""
    for path in evicted:
        evict_page_cache(path, "fadvise")
    if not boxed:
        return load_outputs(run_in_fresh_process(run_spec, version.python, version.comfyui, RUN_TIMEOUT_S), run_spec)
    with box(limit) as cgroup:
        try:
            found = run_in_fresh_process({**run_spec, "box": str(cgroup), "enter_box_before_load": True},
                                         version.python, version.comfyui, RUN_TIMEOUT_S)
        except RuntimeError:
            if oom_kills(cgroup) == 0:
                raise
            return {"killed": True, "box_peak_bytes": int((cgroup / "memory.max_usage_in_bytes").read_text())}
    return load_outputs(found, run_spec)


def oom_kills(cgroup: Path) -> int:
    """How many processes the box's OOM killer has ended (``memory.oom_control``)."""
    fields = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def load_outputs(found: dict[str, Any], run_spec: dict[str, Any]) -> dict[str, Any]:
    """The driver's results with the latents and conditionings it saved."""
    return {**found, "killed": False, "latents": torch.load(run_spec["latent"]),
            "conds": torch.load(run_spec["text_encoder"]["conds"])}


def sampling_anonymous(run_: dict[str, Any]) -> int:
    """The anonymous memory a run added by the time it sampled: RssAnon's peak while sampling (and encoding B), less
    RssAnon before it loaded."""
    marks = run_["rss_anon"]
    return marks["sampled"]["peak"] - marks["before"]["now"]


def steady(values: list[float], steps: int) -> float:
    """The median over each sampling's steps from the third on (one model call a step)."""
    return statistics.median(values[i] for i in range(len(values)) if i % steps >= 2)


def max_delta(found: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest |Δ| between two lists of tensors."""
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(found, expected, strict=True))


def readout(host_limit: str | None) -> str:
    """The text encoder's host limit as its readout names it, without the box's path."""
    return "— (ComfyUI's)" if host_limit is None else host_limit.split(" of /")[0]


def row(name: str, r: dict[str, Any], first: dict[str, Any], plain: dict[str, Any], steps: int) -> list[str]:
    """One table row; the encode times over row 1's (``first``)."""
    if r["killed"]:
        return [name, "**killed** (box OOM)", fmt(r["box_peak_bytes"] / MB, 0), *["—"] * 11]
    te, last = r["text_encoder"], r["calls"][-1]
    packed = " → ".join(fmt(after["stats"]["packed_bytes"] / MB, 0) for after in te["after"]) \
        if te["after"][0]["stats"] else "— (ComfyUI's)"
    seconds, first_seconds = te["encode_seconds"], first["text_encoder"]["encode_seconds"]
    return [name, "yes", fmt(r["box_peak_bytes"] / MB, 0),
            fmt((max(m["peak"] for m in r["rss_anon"].values()) - r["rss_anon"]["before"]["now"]) / MB, 0),
            packed, readout(te["after"][-1]["host_limit"]),
            fmt(last["packed_bytes"] / MB, 0), fmt(r["page_cache_end"]["cached_bytes"] / MB, 0),
            fmt(steady(r["call_read_bytes"], steps) / MB, 0), fmt(steady(r["call_seconds"], steps), 3),
            " / ".join(fmt(s, 2) for s in seconds),
            " / ".join(fmt(s / f, 2) for s, f in zip(seconds, first_seconds, strict=True)),
            " / ".join(fmt(b / MB, 0) for b in te["encode_read_bytes"]),
            f"{max_delta(r['conds'], plain['conds']):g} / {max_delta(r['latents'], plain['latents']):g}"]


HEADERS = ["row", "survived the box", "box peak MB", "peak RssAnon − start MB", "TE packed MB, after A → after B",
           "TE host limit (readout)", "DiT packed MB", "DiT file in page cache at the end MB",
           "DiT read from storage MB/step", "DiT s/step", "encode s, A / B", "encode ÷ row 1's, A / B",
           "TE read from storage MB, A / B", "max abs. difference from plain ComfyUI, conds / latents"]


def measure_version(version, models: ModelDir, clip_name: str, folder: Path, steps: int,
                    smoke: bool) -> tuple[list[list[str]], str]:
    """The rows of one ComfyUI version, and a line on its box."""
    dit = models.models_dir / "diffusion_models" / UNET_NAME
    evicted, dit_bytes = [dit, models.models_dir / "text_encoders" / clip_name], dit.stat().st_size
    out = str(folder / version.name)
    plain = run(spec(models, clip_name, PLAIN_CLIP, "plain", {}, steps, f"{out}-plain"), version, evicted, boxed=False)
    nothing = {"host_memory": "budget", "host_gb": 0.0}
    free = run(spec(models, clip_name, PLAIN_CLIP, "loader", nothing, steps, f"{out}-free"), version, evicted,
               boxed=False)
    limit = sampling_anonymous(free) + (SMOKE_ANON_MARGIN if smoke else 0) + dit_bytes // 2
    budget = {"host_memory": "budget", "host_gb": dit_bytes / GiB}
    rows, found = [], {}
    for index, (name, (clip_node, shared)) in enumerate(ROWS.items()):
        host = budget if shared else {"host_memory": "auto"}
        found[name] = run(spec(models, clip_name, clip_node, "loader", host, steps, f"{out}-row{index}"), version,
                          evicted, limit)
        log.info("%s %s: %s", version.name, name, "killed" if found[name]["killed"] else "done")
        rows.append([version.name, *row(name, found[name], found[next(iter(ROWS))], plain, steps)])
    note = (f"ComfyUI {version.name}: box limit {limit / MB:.0f} MB (the plain-CLIP workflow, nothing packed, added "
            f"{sampling_anonymous(free) / MB:.0f} MB of anonymous memory sampling, outside the box; plus half the "
            f"{dit_bytes / MB:.0f} MB DiT file); host_gb = {budget['host_gb']:.3f} in rows 3 and 4.")
    return rows, note


def section(command: str, seconds: float, steps: int, notes: list[str], rows: list[list[str]]) -> str:
    """The BENCHMARKS.md section: how it was measured, each version's box, the table."""
    return "\n\n".join([
        f"Measured by `.venv/bin/python {command}` on {time.strftime('%Y-%m-%d')}, {seconds / 60:.1f} min; "
        f"{machine()}; ComfyUI with `--cpu`. {steps} steps a sampling (64×64, euler, cfg 1); DiT figures are medians "
        f"over each sampling's steps from the third on; encode times one run each.",
        " ".join(notes),
        markdown_table(["ComfyUI", *HEADERS], rows),
    ])


def main(argv: list[str]) -> int:
    args = section_arguments(__doc__, "tiny files, 4 steps").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started, rows, notes, steps = time.monotonic(), [], [], SMOKE_STEPS if args.smoke else STEPS
    with tempfile.TemporaryDirectory(prefix="text-encoder-box-") as folder:
        models, clip_name = files(Path(folder), args.smoke)
        for version in versions(args.versions):
            version_rows, note = measure_version(version, models, clip_name, Path(folder), steps, args.smoke)
            rows += version_rows
            notes.append(note)
    command = f"bench/text_encoder_box.py{' --versions ' + args.versions if args.versions else ''}"
    publish(HEADING, section(command, time.monotonic() - started, steps, notes, rows),
            write=not (args.smoke or args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
