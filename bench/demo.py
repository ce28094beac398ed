"""Headless demo: real ComfyUI runs a tiny Qwen-Image through Group Offload (no copy-back).

Starts ComfyUI's own server (main.py) on a temporary base directory, queues the API workflow
UNETLoader -> GroupOffload -> KSampler -> GroupOffloadReport -> VAEDecode -> SaveImage, and the same
workflow without the offload node; copies the image to .artifacts/demo/, checks that both images are
identical, and prints what was streamed. The tiny model's weights are random, so the image is noise: what
the demo shows is the mechanism and that it changes no pixel. Run it with ``python3 dev.py demo``.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
from testbed.comfy_boot import ARTIFACTS_DIR
from testbed.live_server import ComfyServer, txt2img_workflow

REPORT_ID = "11"


def offloaded_workflow(unet_name: str, args: argparse.Namespace) -> dict:
    offload = {"blocks_per_group": 1, "prefetch": args.prefetch, "residency": "stream_all", "resident_gb": 0.0}
    workflow = txt2img_workflow(unet_name, seed=args.seed, steps=args.steps, width=args.size, height=args.size,
                                filename_prefix="group_offload_demo", model_patch=("GroupOffload", offload))
    workflow[REPORT_ID] = {"class_type": "GroupOffloadReport", "inputs": {"model": ["10", 0], "samples": ["6", 0]}}
    workflow["7"]["inputs"]["samples"] = [REPORT_ID, 0]
    return workflow


def summary(stats: dict) -> str:
    """What the run streamed, in words a first reader follows."""
    mb = 1e6
    prefetch = stats["prefetch"]
    last = "copy" if prefetch == 1 else f"{prefetch} copies"
    ahead = (f"; with prefetch {prefetch} the copies run ahead, so the run's last {last} may be for a step that "
             f"never comes") if prefetch else ""
    on_the_cpu = (" (ComfyUI runs on the CPU here: the hooks make the copies themselves, so this is mostly copying)"
                  if stats["cpu_only"] else "")
    return "\n".join([
        f"groups of blocks: {stats['groups']}; {stats['resident_groups']} stay on the device, "
        f"{stats['streamed_groups']} are copied to it at every step",
        f"copied to the device: {stats['bytes_per_step'] / mb:.2f} MB a step, {stats['bytes_h2d'] / mb:.2f} MB in "
        f"{stats['copies_h2d']} copies over {stats['steps']} steps (every step copies each streamed group{ahead})",
        f"copied back to the host: {stats['bytes_d2h']} bytes",
        f"host time in the offload hooks: {stats['hook_us_per_group'] / 1000:.2f} ms a group{on_the_cpu}",
        "(on the CPU offloading brings no speed, but every copy is real)" if stats["cpu_only"] else "",
    ]).strip()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="sampling steps (default 4)")
    parser.add_argument("--size", type=int, default=256, help="image width and height in pixels (default 256)")
    parser.add_argument("--prefetch", type=int, default=1, help="groups copied ahead (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ARTIFACTS_DIR / "demo", help="where the image is copied")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    with tempfile.TemporaryDirectory(prefix="group-offload-demo-") as base, ComfyServer(Path(base)) as server:
        unet = server.models.unet_name
        offloaded = server.run(offloaded_workflow(unet, args), timeout=600)
        plain = server.run(txt2img_workflow(unet, seed=args.seed, steps=args.steps, width=args.size,
                                            height=args.size, filename_prefix="plain_demo"), timeout=600)
        [image], [plain_image] = server.output_images(offloaded), server.output_images(plain)
        args.out.mkdir(parents=True, exist_ok=True)
        saved = Path(shutil.copy2(image, args.out / image.name))
        identical = np.array_equal(np.asarray(Image.open(image)), np.asarray(Image.open(plain_image)))

        print(f"image: {saved} (noise: the tiny model's weights are random)")
        print(f"identical to the same workflow without offloading: {'yes' if identical else 'NO'}")
        print(summary(offloaded["outputs"][REPORT_ID]["group_offload"][0]))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
