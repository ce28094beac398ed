"""The user's own kind of machine (issue 33, item 3): a full-size Qwen-Image fp8 ``.safetensors`` (20.4 GB at
``box_blocks`` = 60) written on the local disk (timed, fsynced), then for each (RAM, card) of ``box_machines``:

- the RAM shrunk by the host balloon so that ``MemAvailable`` is the machine's less what its OS holds
  (``box_os_bytes``) and less this process (ComfyUI, booted);
- ComfyUI given the limits it derives from such a machine's RAM (0.33.0's ``comfy/model_management.py`` and
  ``main.py``, Linux, no swap): its pinned-memory limit max(40 %, min(90 %, RAM − 4 GiB, RAM − 16 GiB)) of the RAM,
  its RAM cache headroom min(10, max(2, 10 % of the RAM in GiB)) GiB; and the RAM total that ``psutil`` reports
  (ComfyUI's and this pack's shares of it) is the machine's;
- the page cache dropped before loading (``drop_caches``, else ``fadvise(DONTNEED)`` on the file);
- the card by the device balloon.

Rows: ComfyUI as shipped (Load Diffusion Model, Dynamic VRAM) and this pack's loader (``host_memory = auto``):
load time, first step, steady s/step, the first step of a second generation queued after the first, bytes read
from storage per step and the pack's ``gathered_from_disk_bytes``, peak RSS. On the CPU (``--smoke``) the RAM is
not shrunk and the page cache is dropped for the file only: the rows run, their figures mean nothing."""
from __future__ import annotations

import gc
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from testbed.host_memory import reset_peak, rss_bytes

from ..balloon import Balloon, HostBalloon, mem_available
from ..comfyui import comfy_system, start_comfyui
from ..config import GIB, ROWS, BenchConfig, Row, emit
from ..files import disk_room, safetensors_size, scratch_dir, use_folder_for_models, write_safetensors
from ..sampling import Sampling, end_row, offload_handle

SYSTEMS = (("ComfyUI", "Load Diffusion Model"), ("this pack", "loader, host_memory auto"))
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def comfy_limits(ram: int) -> dict[str, int]:
    """The pinned-memory limit and RAM cache headroom ComfyUI 0.33.0 derives from ``ram`` bytes (Linux, no swap)."""
    pinned = max(ram * 0.40, min(ram * 0.90, ram - 4 * GIB, ram - 16 * GIB))
    headroom = min(10.0, max(2.0, ram / GIB * 0.10)) * GIB
    return {"pinned": int(pinned), "headroom": int(headroom)}


def as_machine(ram: int, smoke: bool) -> str:
    """Give ComfyUI and ``psutil`` a machine of ``ram`` bytes; what was set, for the row's note."""
    import comfy.model_management as mm
    import psutil

    real = getattr(psutil.virtual_memory, "real", psutil.virtual_memory)

    def virtual_memory() -> Any:
        return real()._replace(total=ram)

    virtual_memory.real = real
    psutil.virtual_memory = virtual_memory
    limits = comfy_limits(ram)
    mm.total_ram = ram / 2**20
    headroom = f"RAM cache headroom {limits['headroom'] / 1e9:.1f} GB"
    try:
        from comfy.memory_management import set_ram_cache_release_state
    except ImportError:  # a ComfyUI without a RAM cache (0.3.75)
        headroom = "no RAM cache in this ComfyUI"
    else:
        set_ram_cache_release_state(None, limits["headroom"])
    if not smoke:  # under --cpu ComfyUI pins nothing, and must not start
        mm.MAX_PINNED_MEMORY = limits["pinned"]
    return (f"pinned-memory limit {limits['pinned'] / 1e9:.1f} GB, {headroom}"
            f" (ComfyUI 0.33.0's rules for {ram / 1e9:.0f} GB)")


def drop_page_cache(path: Path, smoke: bool) -> str:
    if not smoke and os.access(DROP_CACHES, os.W_OK):
        os.sync()
        DROP_CACHES.write_text("1")
        return "drop_caches"
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)
    return "fadvise DONTNEED"


def load(system: str, name: str) -> Any:
    from testbed.run_nodes import run_node

    if system == "this pack":
        return run_node("GroupOffloadLoader", unet_name=name, weight_dtype="default", blocks_per_group=1,
                        prefetch=1, residency="auto", resident_gb=0.0, host_memory="auto").outputs[0]
    return run_node("UNETLoader", unet_name=name, weight_dtype="default").outputs[0]


def box_row(row: Row, path: Path, config: BenchConfig, ram: int, host: HostBalloon, balloon: Balloon) -> None:
    balloon.set_cap(row.cap_bytes)
    limits = as_machine(ram, config.smoke)
    shrunk = "RAM not shrunk (--smoke)"
    if not config.smoke:
        host.hold_to_leave(ram - config.box_os_bytes - rss_bytes())
        shrunk = f"MemAvailable {mem_available() / 1e9:.1f} GB"
    dropped = drop_page_cache(path, config.smoke)
    reset_peak()
    started = time.perf_counter()
    model = load(row.system, path.name)
    row.load_s = time.perf_counter() - started
    try:
        Sampling(model, config).run().fill(row)
        handle = offload_handle(model)
        if handle is not None:
            row.disk_bytes = handle.stats()["gathered_from_disk_bytes"] / len(row.step_s)
        row.second_first_step_s = Sampling(model, config).run(seed=1).clock.steps[0]
    except torch.cuda.OutOfMemoryError as error:
        row.skipped = f"out of memory: {str(error).splitlines()[0][:160]}"
    row.note = "; ".join(filter(None, [row.note, shrunk, limits, f"page cache: {dropped}"]))
    del model
    gc.collect()


def box_family(config: BenchConfig, out: Path) -> None:
    comfyui = comfy_system(start_comfyui(config, dynamic=True))
    config_file = replace(config, blocks=config.box_blocks)
    folder, host, balloon = scratch_dir(), HostBalloon(), Balloon(config.device)
    limit_s = config.row_limit_s * 2 + 120  # a cold load and two generations
    rows = [(Row("box", comfyui if system == "ComfyUI" else system, mode, f"{ram / GIB:.0f} GB RAM", card,
                 limit_s=limit_s), ram) for ram, card in config.box_machines for system, mode in SYSTEMS]
    why = disk_room(folder, safetensors_size(config_file, torch.float8_e4m3fn))
    path = folder / f"qwen_image_{config.box_blocks}_blocks_fp8.safetensors"
    try:
        if why is None:
            emit("fact", {"box_file": write_safetensors(path, config_file, torch.float8_e4m3fn)})
            use_folder_for_models(folder)
        for row, ram in rows:
            if not ROWS.begin(row, config):
                continue
            if why is None:
                box_row(row, path, config_file, ram, host, balloon)
            else:
                row.skipped = why
            end_row(row)
    finally:
        host.release()
        path.unlink(missing_ok=True)
