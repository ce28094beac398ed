"""Loads one model in this fresh process, samples it, and prints what host memory it took, as JSON.

Run by tests/test_host_budget.py, one process per measurement, so that each starts from the same
anonymous memory: ``host_budget_driver.py SPEC_JSON`` with the spec's keys

- ``models``: a ComfyUI base folder with ``models/diffusion_models`` (see ``fixture_models.ModelDir``);
- ``unet_name``: the file to load there;
- ``via``: ``plain`` (Load Diffusion Model), ``node`` (Load Diffusion Model, then Group Offload) or
  ``loader`` (Load Diffusion Model (Group Offload));
- ``offload``: the offload node's inputs beside ``test_nodes.OFFLOAD_DEFAULTS`` (``host_memory``, ``host_gb``);
- ``latent``: where to save the sampled latent (``torch.save``).

It prints ``RESULTS {...}``: RssAnon (the process's anonymous resident memory; page cache and other
file-backed pages not counted) at each mark (``before``, on the node's path ``comfyui_loaded`` once
ComfyUI's own load is done, ``loaded``, ``sampled``) with its peak since the mark before, the handle's
``stats()`` after each diffusion-model call.
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))

from comfy_boot import boot_comfyui_in_process  # noqa: E402
from fixture_models import ModelDir, use_models_in_process, widen_qwen_detection  # noqa: E402
from host_memory import _status_kib  # noqa: E402
from run_nodes import run_node, run_txt2img  # noqa: E402
from test_nodes import OFFLOAD_DEFAULTS, offload_handle  # noqa: E402

SEED = 5
STEPS = 3
SAMPLE_EVERY_S = 0.02


def rss_anon() -> int:
    """This process's anonymous resident memory now, in bytes (``RssAnon`` of /proc/self/status)."""
    return _status_kib("RssAnon") * 1024


class AnonMarks:
    """RssAnon at named marks, with its peak since the mark before, read every 20 ms by a thread: the kernel
    keeps no peak of it (``VmHWM`` counts file-backed pages too)."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "AnonMarks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            with self._lock:
                self._peak = max(self._peak, rss_anon())

    def mark(self, name: str) -> None:
        """Note RssAnon now and its peak since the last mark; the next peak starts from now."""
        with self._lock:
            now = rss_anon()
            self.marks[name] = {"now": now, "peak": max(self._peak, now)}
            self._peak = now


def load(spec: dict[str, Any], anon: AnonMarks):
    """The MODEL the spec asks for; the node's path marks ``comfyui_loaded`` once ComfyUI's own load is done."""
    offload = OFFLOAD_DEFAULTS | spec.get("offload", {})
    if spec["via"] == "loader":
        return run_node("GroupOffloadLoader", unet_name=spec["unet_name"], weight_dtype="default", **offload).outputs[0]
    plain = run_node("UNETLoader", unet_name=spec["unet_name"], weight_dtype="default").outputs[0]
    if spec["via"] == "plain":
        return plain
    anon.mark("comfyui_loaded")
    return run_node("GroupOffload", model=plain, **offload).outputs[0]


def stats_after_each_call(model, offloaded: bool) -> list[dict[str, Any]]:
    """The handle's ``stats()`` after each diffusion-model call (one call a step when cond and uncond run as one
    batch), filled as the model runs; ``{}`` for each call of a model without offloading."""
    after: list[dict[str, Any]] = []
    model.model.diffusion_model.register_forward_hook(
        lambda module, args, output: after.append(offload_handle(model).stats() if offloaded else {}))
    return after


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    boot_comfyui_in_process()
    widen_qwen_detection()
    use_models_in_process(ModelDir(Path(spec["models"])))
    with AnonMarks() as anon:
        anon.mark("before")
        model = load(spec, anon)
        anon.mark("loaded")
        calls = stats_after_each_call(model, offloaded=spec["via"] != "plain")
        latent = run_txt2img(model, seed=SEED, steps=STEPS).latent
        anon.mark("sampled")
    torch.save(latent, spec["latent"])
    return {
        "rss_anon": anon.marks,
        "calls": calls,
    }


if __name__ == "__main__":
    print("RESULTS " + json.dumps(measure(json.loads(sys.argv[1]))))
