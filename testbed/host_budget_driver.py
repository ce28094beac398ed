"""Loads one model in this fresh process, samples it, and prints what host memory it took, as JSON.

Run by tests/bench/test_host_budget.py, one process per measurement, so that each starts from the same
anonymous memory: ``host_budget_driver.py SPEC_JSON`` with the spec's keys

- ``models``: a ComfyUI base folder with ``models/diffusion_models`` (see ``fixture_models.ModelDir``);
- ``unet_name``: the file to load there;
- ``gguf`` (optional): true to load it with ComfyUI-GGUF's Unet Loader (GGUF) in place of Load Diffusion Model
  (``via`` ``plain`` or ``node``);
- ``via``: ``plain`` (Load Diffusion Model), ``node`` (Load Diffusion Model, then Group Offload) or
  ``loader`` (Load Diffusion Model (Group Offload));
- ``offload``: the offload node's inputs beside ``node_runs.OFFLOAD_DEFAULTS`` (``host_memory``, ``host_gb``);
- ``latent``: where to save the sampled latent (``torch.save``);
- ``steps`` (optional, 3 by default): the sampling steps;
- ``evict`` (optional): ``drop_caches`` or ``fadvise``, to make the page cache cold for the model file
  right before sampling (:func:`evict_page_cache`);
- ``box`` (optional): a memory cgroup (v1) the process enters once loaded, made by the caller with its
  limit: the page cache it reads while sampling and the anonymous memory it adds are held to that, as on
  a machine with that much RAM free (:func:`enter_box`);
- ``enter_box_before_load`` (optional): true to enter the box before loading, as a process in a container
  starts inside its limit;
- ``lru`` (optional): true to leave the page cache to the kernel's LRU, as before the engine kept a stable
  part of it (the patcher's ``_keep_page_cache`` does nothing);
- ``through_cache`` (optional): true to read every group kept in place through the page cache, as before the
  engine read the pages it does not keep cached around it (no file opens for direct reads);
- ``text_encoder`` (optional): a Qwen-Image workflow around the sampling (:class:`TextEncoderRun`): the text
  encoder ``clip_name`` (in ``models/text_encoders``) loaded by ``node`` (``CLIPLoader`` or
  ``GroupOffloadCLIPLoader``, with the offload inputs ``offload`` beside ``OFFLOAD_DEFAULTS``) before the diffusion
  model, the first of ``prompts`` encoded, the model loaded and sampled (cfg 1), the second prompt encoded and the
  model sampled again; both conditionings saved under ``conds``, both latents under ``latent``.

It prints ``RESULTS {...}``: RssAnon (the process's anonymous resident memory; page cache and other file-backed
pages not counted) at each mark (``before``, on the node's path ``comfyui_loaded`` once ComfyUI's own load is
done, ``loaded``, ``sampled``) with its peak since the mark before and its time; for each diffusion-model call
(one a step) the handle's ``stats()`` after it (``calls``), its wall time (``call_seconds``) and the bytes the
process read from storage meanwhile (``call_read_bytes``, from ``/proc/self/io``: every thread, the kernel's
read-ahead included); how much of the model file the page cache held as sampling started and as it ended
(``page_cache``, ``page_cache_end``); in a box, its ``memory.stat`` after each call (``box_stats``:
``total_cache``, ``total_rss``, in bytes) and its peak (``box_peak_bytes``); the bytes of each group kept in
place (``in_place_group_bytes``); the limit that bound the host budget (``host_limit``); the ComfyUI and torch
versions; with ``text_encoder``, under ``text_encoder`` each encode's seconds and bytes read from storage, and
the text encoder's handle's ``stats()`` and host limit after each encode (``{}`` and None for ComfyUI's Load
CLIP).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run by path: the repository root, for testbed

from offload_core import hostmem  # noqa: E402
from testbed import gguf_files, text_encoders  # noqa: E402
from testbed.comfy_boot import boot_comfyui_in_process, comfyui_path, comfyui_version  # noqa: E402
from testbed.fixture_models import ModelDir, use_models_in_process, widen_qwen_detection  # noqa: E402
from testbed.host_memory import PeakAnonymous, rss_anon_bytes  # noqa: E402
from testbed.node_runs import OFFLOAD_DEFAULTS, offload_handle  # noqa: E402
from testbed.pack_modules import pack_module  # noqa: E402
from testbed.run_nodes import node_output, run_node, run_txt2img  # noqa: E402

SEED = 5
STEPS = 3
SAMPLE_EVERY_S = 0.02
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
RESULTS_PREFIX = "RESULTS "
# Twelve 37.8 MB blocks, 4 MB besides: a budget of a quarter packs three of them or fewer.
MODEL = {"num_layers": 12, "num_attention_heads": 4, "attention_head_dim": 128, "dtype": torch.float32}
UNET_NAME = "host_budget_qwen_image.safetensors"
GiB = 1024**3  # the unit of host_gb (``OffloadSettings.host_bytes``)


class AnonMarks(PeakAnonymous):
    """RssAnon at named marks, with its peak since the mark before, read every 20 ms by a thread: the kernel
    keeps no peak of it (``VmHWM`` counts file-backed pages too); and when each mark was (``at_s``, seconds
    since the marks began)."""

    def __init__(self) -> None:
        super().__init__(SAMPLE_EVERY_S)
        self.marks: dict[str, dict[str, float]] = {}
        self._started = time.perf_counter()

    def mark(self, name: str) -> None:
        """Note RssAnon now and its peak since the last mark; the next peak starts from now."""
        with self._lock:
            now = rss_anon_bytes()
            self.marks[name] = {"now": now, "peak": max(self.peak, now), "at_s": time.perf_counter() - self._started}
            self.peak = now


def load(spec: dict[str, Any], anon: AnonMarks):
    """The MODEL the spec asks for; the node's path marks ``comfyui_loaded`` once ComfyUI's own load is done."""
    offload = OFFLOAD_DEFAULTS | spec.get("offload", {})
    if spec["via"] == "loader":
        return run_node("GroupOffloadLoader", unet_name=spec["unet_name"], weight_dtype="default", **offload).outputs[0]
    if spec.get("gguf"):
        gguf_files.load_comfyui_gguf(boot_comfyui_in_process())
        plain = run_node("UnetLoaderGGUF", unet_name=spec["unet_name"]).outputs[0]
    else:
        plain = run_node("UNETLoader", unet_name=spec["unet_name"], weight_dtype="default").outputs[0]
    if spec["via"] == "plain":
        return plain
    anon.mark("comfyui_loaded")
    return run_node("GroupOffload", model=plain, **offload).outputs[0]


class TextEncoderRun:
    """The text encoder of a ``text_encoder`` spec: loaded as the spec says, then each prompt encoded (CLIPTextEncode)
    with its seconds, the bytes read from storage meanwhile, and the handle's ``stats()`` and host limit after it."""

    def __init__(self, spec: dict[str, Any], models: ModelDir) -> None:
        text_encoders.use_text_encoders_in_process(models.models_dir)
        offload = OFFLOAD_DEFAULTS | spec.get("offload", {}) if spec["node"] != "CLIPLoader" else {}
        self.spec, self.conds, self.results = spec, [], {"encode_seconds": [], "encode_read_bytes": [], "after": []}
        self.clip = node_output(spec["node"], clip_name=spec["clip_name"], type="qwen_image", **offload)

    def encode(self, index: int) -> list:
        """The CONDITIONING of prompt ``index``, noted."""
        started, read_before = time.perf_counter(), io_read_bytes()
        conditioning = node_output("CLIPTextEncode", clip=self.clip, text=self.spec["prompts"][index])
        self.results["encode_seconds"].append(time.perf_counter() - started)
        self.results["encode_read_bytes"].append(io_read_bytes() - read_before)
        handle = pack_module("nodes.model_state").state_of(self.clip.patcher.model).handle
        self.results["after"].append({
            "stats": {} if handle is None else handle().stats(),
            "host_limit": pack_module("nodes.handles").host_limit(self.clip.patcher.model)})
        self.conds.append(conditioning[0][0])
        return conditioning


def sample_on(model, conditioning: list, steps: int) -> torch.Tensor:
    """The latent of ``model`` sampled on ``conditioning`` at cfg 1 (one model call a step)."""
    return run_txt2img(model, seed=SEED, steps=steps, cfg=1.0, positive=conditioning, negative=conditioning).latent


def io_read_bytes() -> int:
    """What this process (all its threads) has had read from storage so far (``read_bytes`` of /proc/self/io)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"])


class ModelCalls:
    """Each diffusion-model call (one a step when cond and uncond run as one batch), filled as the model runs:
    its wall time, the bytes read from storage during it, and the handle's ``stats()`` after it (``{}`` for a
    model without offloading)."""

    def __init__(self, model, offloaded: bool, box: Path | None = None) -> None:
        self.stats: list[dict[str, Any]] = []
        self.seconds: list[float] = []
        self.read_bytes: list[int] = []
        self.box_stats: list[dict[str, int]] = []
        self._model, self._offloaded, self._box = model, offloaded, box
        self._entered = (0.0, 0)
        model.model.diffusion_model.register_forward_pre_hook(self._enter)
        model.model.diffusion_model.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        self._entered = (time.perf_counter(), io_read_bytes())

    def _exit(self, *_: Any) -> None:
        started, read_before = self._entered
        self.seconds.append(time.perf_counter() - started)
        self.read_bytes.append(io_read_bytes() - read_before)
        self.stats.append(offload_handle(self._model).stats() if self._offloaded else {})
        if self._box is not None:
            self.box_stats.append(box_stats(self._box))


_MADV_DONTNEED = 4


def _unmap_pages_of(path: Path) -> None:
    """This process's page-table entries for ``path``'s mappings, dropped (the pages stay in the page cache)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    target = os.stat(path)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        read_only = len(fields) == 6 and "w" not in fields[1]  # (a written private page would be lost)
        if read_only and fields[4] == str(target.st_ino) and fields[5] == str(Path(path).resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) on a mapping of {path}")


def evict_page_cache(path: Path, method: str) -> None:
    """Make the page cache cold for the file at ``path``: ``drop_caches`` drops the clean pages of the whole
    machine's page cache (``sync; echo 1 > /proc/sys/vm/drop_caches``), ``fadvise`` those of this file only
    (fsync, then ``POSIX_FADV_DONTNEED``). Neither drops a page some process has mapped, so this process's own
    mappings of the file let go of their pages first (``MADV_DONTNEED``: a file mapping reads them again from the
    file when touched), as memory pressure would: the loader's mapping holds the pages loading touched (the
    vectors read at once, the groups packed at load), which on a small model are most of the file."""
    _unmap_pages_of(path)
    if method == "drop_caches":
        os.sync()
        DROP_CACHES.write_text("1")
    elif method == "fadvise":
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    else:
        raise ValueError(f"evict must be drop_caches or fadvise, not {method!r}")


def enter_box(cgroup: Path) -> None:
    """Move this process into the memory cgroup ``cgroup``: what it charges from now on counts against its limit
    (memory charged before stays where it was)."""
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))


def box_stats(cgroup: Path) -> dict[str, int]:
    """The box's page cache and anonymous memory now (``memory.stat``)."""
    fields = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    return {name: int(fields[name]) for name in ("total_cache", "total_rss")}


def page_cache(path: Path) -> dict[str, int]:
    """The file's size and how many of its bytes the page cache holds (mincore)."""
    hostmem = pack_module("offload_core.hostmem")
    whole = hostmem.map_file(path)  # mapped, never read: mincore asks the page cache, not this mapping
    return {"file_bytes": whole.numel(), "cached_bytes": whole.numel() - hostmem.uncached_bytes(whole)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    boot_comfyui_in_process()
    widen_qwen_detection()
    models = ModelDir(Path(spec["models"]))
    use_models_in_process(models)
    model_file = models.models_dir / "diffusion_models" / spec["unet_name"]
    box = Path(spec["box"]) if "box" in spec else None
    if spec.get("lru"):
        pack_module("nodes.patcher")._keep_page_cache = lambda handle, base_model: None
    if spec.get("through_cache"):
        pack_module("offload_core.hostmem").open_direct = lambda descriptor: None
    steps, workflow = spec.get("steps", STEPS), None
    with AnonMarks() as anon:
        anon.mark("before")
        if box is not None and spec.get("enter_box_before_load"):
            enter_box(box)
        if "text_encoder" in spec:
            workflow = TextEncoderRun(spec["text_encoder"], models)
            conditioning = workflow.encode(0)
        model = load(spec, anon)
        anon.mark("loaded")
        calls = ModelCalls(model, offloaded=spec["via"] != "plain", box=box)
        if "evict" in spec:
            evict_page_cache(model_file, spec["evict"])
        if box is not None and not spec.get("enter_box_before_load"):
            enter_box(box)
        cached = page_cache(model_file)
        if workflow is None:
            latent = run_txt2img(model, seed=SEED, steps=steps).latent
        else:
            latent = [sample_on(model, conditioning, steps), sample_on(model, workflow.encode(1), steps)]
            torch.save(workflow.conds, spec["text_encoder"]["conds"])
        anon.mark("sampled")
    torch.save(latent, spec["latent"])
    return {
        **({} if workflow is None else {"text_encoder": workflow.results}),
        "rss_anon": anon.marks,
        "calls": calls.stats,
        "call_seconds": calls.seconds,
        "call_read_bytes": calls.read_bytes,
        "page_cache": cached,
        "page_cache_end": page_cache(model_file),
        "in_place_group_bytes": [] if spec["via"] == "plain" else
        [group.nbytes for group in offload_handle(model).groups if not group.mirror.packed],
        "host_limit": None if spec["via"] == "plain" else pack_module("nodes.handles").host_limit(model.model),
        **({"box_stats": calls.box_stats, "box_peak_bytes": int((box / "memory.max_usage_in_bytes").read_text())}
           if box is not None else {}),
        "versions": {"comfyui": comfyui_version(), "torch": torch.__version__},
    }


def run_in_fresh_process(spec: dict[str, Any], python: str | Path = sys.executable, comfyui: Path | None = None,
                         timeout: float = 300) -> dict[str, Any]:
    """This driver's results for ``spec``, run by ``python`` with the ComfyUI checkout ``comfyui`` (by default
    the one in use here); ``RuntimeError`` with the end of its log when it fails."""
    env = dict(os.environ, COMFYUI_PATH=str(comfyui or comfyui_path()))
    done = subprocess.run([str(python), __file__, json.dumps(spec)], capture_output=True, text=True, timeout=timeout,
                          env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULTS_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"host_budget_driver failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULTS_PREFIX))


def ram_and_swap_bytes() -> int:
    fields = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))


def sample_small_and_big(models: ModelDir, tmp_path: Path, small: str, big: str, via: str,
                         **spec: object) -> tuple[dict, dict]:
    """The driver's results, each in a fresh process: ``small`` through ComfyUI alone and ``big`` (the same
    weights and a hole) ``via`` the loader or the node with nothing packed; the latents are bit-identical and
    the hole is never read. Reading a hole costs no read from storage (``read_bytes``) but leaves zeroed pages
    in the page cache; a copy of it would be anonymous memory."""
    spec = {"models": str(models.base_dir), "steps": 2, **spec}
    plain = run_in_fresh_process(
        {**spec, "unet_name": small, "via": "plain", "latent": str(tmp_path / "plain.pt")})
    ours = run_in_fresh_process(
        {**spec, "unet_name": big, "via": via, "latent": str(tmp_path / "ours.pt"),
         "offload": {"host_memory": "budget", "host_gb": 0.0}})
    stats = ours["calls"][-1]
    assert stats["packed_bytes"] == 0 and stats["in_place_bytes"] == stats["host_bytes"] > 0
    assert ours["call_read_bytes"] and max(ours["call_read_bytes"]) < 2**30
    whole = hostmem.map_file(models.models_dir / "diffusion_models" / big)
    assert whole.numel() - hostmem.uncached_bytes(whole) < 2**30, "the hole is never read"
    assert anon_peak(ours) < anon_peak(plain) + 2**30
    assert torch.equal(torch.load(tmp_path / "ours.pt"), torch.load(tmp_path / "plain.pt"))
    return plain, ours


def anon_peak(results: dict) -> int:
    """The process's peak anonymous memory over a driver run."""
    return max(mark["peak"] for mark in results["rss_anon"].values())


if __name__ == "__main__":
    print(RESULTS_PREFIX + json.dumps(measure(json.loads(sys.argv[1]))))
