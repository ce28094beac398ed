"""GGUF (issue 31's GPU part): full-size Qwen-Image as a GGUF file on the local disk, Q8_0 (≈ 21.8 GB) and Q4_K
(crafted blocks, ≈ 12 GB); ComfyUI-GGUF as shipped (a legacy ModelPatcher subclass: Dynamic VRAM never applies,
each layer copied synchronously on the compute stream) against this pack's ``auto`` and ``stream_all`` p2 at caps
where a third or more of the model streams. Each file is deleted once its rows are done."""
from __future__ import annotations

import gc
from pathlib import Path

from ..balloon import Balloon
from ..comfyui import start_comfyui
from ..config import ROWS, BenchConfig, Row, emit
from ..files import disk_room, gguf_size, scratch_dir, use_folder_for_models, write_gguf
from ..sampling import end_row, offload_row, sample_row

GGUF_ROWS = (("auto", {"residency": "auto", "prefetch": 1}), ("stream_all p2", {"residency": "stream_all", "prefetch": 2}))


def _rows(config: BenchConfig, dtype: str, caps: tuple[int, ...]) -> list[Row]:
    rows = [Row("gguf", "all resident", "ComfyUI-GGUF, resident", dtype, None)]
    for cap in caps:
        rows += [Row("gguf", "ComfyUI-GGUF", "as shipped", dtype, cap)]
        rows += [Row("gguf", "this pack", mode, dtype, cap) for mode, _ in GGUF_ROWS]
    return rows


def _skip_all(rows: list[Row], config: BenchConfig, why: str) -> None:
    for row in rows:
        if ROWS.begin(row, config):
            row.skipped = why
            end_row(row)


def gguf_family(config: BenchConfig, out: Path) -> None:
    from testbed.comfy_boot import boot_comfyui_in_process
    from testbed.gguf_files import QType, comfyui_gguf_missing, load_comfyui_gguf
    from testbed.run_nodes import run_node

    start_comfyui(config, dynamic=True)
    missing = comfyui_gguf_missing()
    if missing is None:
        load_comfyui_gguf(boot_comfyui_in_process())
    folder, balloon = scratch_dir(), Balloon(config.device)
    use_folder_for_models(folder)
    settings = dict(GGUF_ROWS)
    for name, caps in config.gguf_caps_bytes.items():
        rows = _rows(config, f"GGUF {name}", caps)
        why = missing or disk_room(folder, gguf_size(config, QType[name]))
        if why:
            _skip_all(rows, config, why)
            continue
        path = folder / f"qwen_image_{config.blocks}_blocks_{name}.gguf"
        try:
            emit("fact", {f"gguf_{name}_file": write_gguf(path, config, QType[name])})
            plain = run_node("UnetLoaderGGUF", unet_name=path.name).outputs[0]
            for row in rows:
                if row.system == "this pack":
                    offload_row(row, plain, settings[row.mode], config, balloon)
                else:
                    sample_row(row, plain, config, balloon)
            del plain
            balloon.set_cap(None)
            gc.collect()
        finally:
            path.unlink(missing_ok=True)
