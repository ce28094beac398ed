"""Broken files and impossible numbers get one clear sentence, through the node and through the server,
and the server keeps working."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from testbed import fixture_models
from testbed.live_server import PromptRejected, txt2img_workflow
from testbed.run_nodes import run_node

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "budget", "resident_gb": 0.0}


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(header: dict, data: bytes) -> bytes:
    return _framed(json.dumps(header).encode()) + data


def _edited(edit) -> bytes:
    """The tiny model with its header changed by ``edit(header)``."""
    header, data = _split(fixture_models.tiny_qwen_image_file())
    edit(header)
    return _join(header, data)


def _tensors(header: dict) -> list[dict]:
    return [entry for key, entry in sorted(header.items()) if key != "__metadata__"]


def _overlap(header: dict) -> None:
    first, second = sorted(_tensors(header), key=lambda e: e["data_offsets"][0])[:2]
    second["data_offsets"] = list(first["data_offsets"])
    second["shape"], second["dtype"] = first["shape"], first["dtype"]


def _unknown_dtype(header: dict) -> None:
    _tensors(header)[0]["dtype"] = "X99"


def _wrong_span(header: dict) -> None:
    _tensors(header)[0]["shape"] = [n + 1 for n in _tensors(header)[0]["shape"]]


def _framed(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


def _valid() -> bytes:
    return fixture_models.tiny_qwen_image_file().read_bytes()


# name -> (the file's bytes, what the sentence must say)
BROKEN = {
    "empty": (lambda: b"", "it is empty"),
    "short": (lambda: b"abc", "it is only 3 bytes long"),
    "not_json": (lambda: _framed(b"\xff\xfenot{json"), "its header is not JSON"),
    "json_list": (lambda: _framed(b"[]"), "its header is not a JSON object"),
    "random_bytes": (lambda: random.Random(0).randbytes(4096), "more than a safetensors header may have"),
    "header_claims_2_40": (lambda: (2**40).to_bytes(8, "little") + _valid()[8:], "claims 1099511627776 bytes"),
    "truncated": (lambda: _valid()[: len(_valid()) // 2], "it is truncated"),
    "unknown_dtype": (lambda: _edited(_unknown_dtype), "has dtype 'X99'"),
    "wrong_span": (lambda: _edited(_wrong_span), "but its shape and dtype need"),
    "overlap": (lambda: _edited(_overlap), "overlaps"),
}


def write_broken(folder: Path, case: str) -> str:
    name = f"broken_{case}.safetensors"
    (folder / name).write_bytes(BROKEN[case][0]())
    return name


def assert_one_sentence(message: str, name: str, case: str) -> None:
    assert message.startswith(f"{name} is not a valid safetensors file (")
    assert BROKEN[case][1] in message and "\n" not in message and message.count(". ") == 0


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_file_is_named_in_one_sentence_by_the_node(comfy_models, case):
    name = write_broken(comfy_models.models_dir / "diffusion_models", case)
    with pytest.raises(ValueError) as error:
        run_node("GroupOffloadLoader", unet_name=name, weight_dtype="default", **OFFLOAD)
    assert_one_sentence(str(error.value), name, case)


def test_broken_files_through_the_server_which_keeps_working(comfy_server):
    folder = comfy_server.models.models_dir / "diffusion_models"
    names = {case: write_broken(folder, case) for case in BROKEN}
    for case, name in names.items():
        workflow = txt2img_workflow(comfy_server.models.unet_name, seed=81)
        workflow["1"] = {"class_type": "GroupOffloadLoader", "inputs": {"unet_name": name, "weight_dtype": "default", **OFFLOAD}}
        entry = comfy_server.wait(comfy_server.queue(workflow), check=False)
        error = next(m[1] for m in entry["status"]["messages"] if m[0] == "execution_error")
        assert (error["node_type"], error["exception_type"]) == ("GroupOffloadLoader", "ValueError")
        assert_one_sentence(error["exception_message"].rstrip("\n"), name, case)  # ComfyUI appends a newline
    assert comfy_server.output_images(comfy_server.run(txt2img_workflow(comfy_server.models.unet_name, seed=82)))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("node", ["GroupOffload", "GroupOffloadLoader"])
def test_nan_and_infinite_resident_gb_fail_validation(comfy_server, node, value):
    name = comfy_server.models.unet_name
    options = OFFLOAD | {"resident_gb": value}
    if node == "GroupOffload":
        workflow = txt2img_workflow(name, seed=83, model_patch=(node, options))
        node_id = "10"
    else:
        workflow = txt2img_workflow(name, seed=83)
        workflow["1"] = {"class_type": node, "inputs": {"unet_name": name, "weight_dtype": "default", **options}}
        node_id = "1"
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(workflow)  # refused before anything runs
    body = rejected.value.body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    (error,) = body["node_errors"][node_id]["errors"]
    assert error["type"] == "custom_validation_failed"
    assert error["details"] == f"resident_gb - resident_gb must be a finite number from 0 to 4096 (GB), got {value}"
    assert comfy_server.run(txt2img_workflow(name, seed=84))["status"]["status_str"] == "success", "the next prompt works"


def test_in_range_resident_gb_still_passes_and_the_node_refuses_nan_itself(comfy_server, comfy_models):
    name = comfy_server.models.unet_name
    entry = comfy_server.run(txt2img_workflow(name, seed=85, model_patch=("GroupOffload", OFFLOAD | {"resident_gb": 4096.0})))
    assert comfy_server.output_images(entry)
    plain = run_node("UNETLoader", unet_name=fixture_models.TINY_QWEN_NAME, weight_dtype="default").outputs[0]
    with pytest.raises(ValueError, match="resident_gb must be a finite number"):
        run_node("GroupOffload", model=plain, **(OFFLOAD | {"resident_gb": math.nan}))
