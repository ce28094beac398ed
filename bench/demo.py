"""Headless demo: real ComfyUI serves a tiny Qwen-Image through this pack's GroupOffload node.

Starts ComfyUI's own server (main.py) on a temporary base directory, queues the API workflow
UNETLoader -> GroupOffload -> KSampler -> VAEDecode -> SaveImage (+ GroupOffloadReport), copies the
image to .artifacts/demo/ and prints what was streamed. Without the pack's nodes the offload step is
skipped and the demo says so. Run it with ``python3 dev.py demo``.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from comfy_env import ARTIFACTS_DIR, ComfyServer, txt2img_workflow  # noqa: E402

logger = logging.getLogger("demo")

OFFLOAD_NODE = "GroupOffload"
REPORT_NODE = "GroupOffloadReport"
REPORT_ID = "11"
# Outputs of txt2img_workflow() that a node input of this type is wired to; "10" is the offload node.
LINKS_BY_TYPE = {"MODEL": ["10", 0], "LATENT": ["6", 0], "IMAGE": ["7", 0]}


def _inputs_from_defaults(node_info: dict, links: dict[str, list]) -> dict[str, Any] | None:
    """Required inputs of a node from /object_info: linked by type, else the widget default.

    Returns ``None`` when an input can be neither linked nor defaulted.
    """
    inputs: dict[str, Any] = {}
    for name, spec in node_info["input"].get("required", {}).items():
        kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
        if isinstance(kind, list):  # V1 combo: the list of choices
            inputs[name] = kind[0]
        elif kind == "COMBO":  # V3 combo
            inputs[name] = options["options"][0]
        elif kind in links:
            inputs[name] = links[kind]
        elif "default" in options:
            inputs[name] = options["default"]
        else:
            logger.warning("cannot fill input %r (%s) of %s", name, kind, node_info.get("name"))
            return None
    return inputs


def _build_workflow(server: ComfyServer, args: argparse.Namespace) -> tuple[dict, bool, bool]:
    workflow_args = dict(seed=args.seed, steps=args.steps, width=args.size, height=args.size,
                         filename_prefix="group_offload_demo")
    offload_info = server.object_info.get(OFFLOAD_NODE)
    offload_inputs = _inputs_from_defaults(offload_info, {"MODEL": ["1", 0]}) if offload_info else None
    if offload_inputs is None:
        return txt2img_workflow(server.models.unet_name, **workflow_args), False, False
    workflow = txt2img_workflow(server.models.unet_name, model_patch=(OFFLOAD_NODE, offload_inputs), **workflow_args)

    report_info = server.object_info.get(REPORT_NODE)
    report_inputs = _inputs_from_defaults(report_info, LINKS_BY_TYPE) if report_info else None
    if report_inputs is not None:
        workflow[REPORT_ID] = {"class_type": REPORT_NODE, "inputs": report_inputs}
    return workflow, True, report_inputs is not None


def _print_report(ui: dict) -> None:
    texts = [line for value in ui.values() if isinstance(value, list) for line in value if isinstance(line, str)]
    if texts:
        print("\n".join(texts))
    else:
        print(json.dumps(ui, indent=2))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="sampling steps (default 4)")
    parser.add_argument("--size", type=int, default=256, help="image width and height in pixels (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ARTIFACTS_DIR / "demo", help="where the image is copied")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    with tempfile.TemporaryDirectory(prefix="group-offload-demo-") as base, ComfyServer(Path(base)) as server:
        workflow, offloaded, reported = _build_workflow(server, args)
        entry = server.run(workflow, timeout=600)
        [image] = server.output_images(entry)
        args.out.mkdir(parents=True, exist_ok=True)
        saved = Path(shutil.copy2(image, args.out / image.name))

        print(f"image: {saved}")
        if not offloaded:
            print(f"The {OFFLOAD_NODE} node is not installed (or its inputs are unknown to this demo): "
                  "the model ran without group offloading.")
        elif not reported:
            print(f"The model ran through {OFFLOAD_NODE}; no {REPORT_NODE} node to report what was streamed.")
        else:
            _print_report(entry["outputs"].get(REPORT_ID, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
