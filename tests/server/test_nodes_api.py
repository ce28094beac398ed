"""The nodes through ComfyUI's HTTP API: a real server, API-format prompts, /history and /free."""
from __future__ import annotations

import numpy as np
import pytest

from testbed.live_server import PromptRejected, txt2img_workflow
from testbed.lora_fixture import make_lora
from testbed.live_server import OFFLOAD, pixels, report_of, with_report


@pytest.mark.parametrize("node, options", [
    ("GroupOffload", OFFLOAD),
    ("GroupOffload", OFFLOAD | {"prefetch": 0, "blocks_per_group": 2}),
    ("GroupOffload", OFFLOAD | {"residency": "budget", "resident_gb": 0.0002}),
    ("GroupOffloadLoader", OFFLOAD),
])
def test_offloaded_image_matches_plain(comfy_server, node, options):
    name = comfy_server.models.unet_name
    seed = 11 + len(options) + len(node)  # vary the prompt so ComfyUI's cache cannot answer it
    plain = comfy_server.run(txt2img_workflow(name, seed=seed, filename_prefix="plain"))
    if node == "GroupOffload":
        workflow = txt2img_workflow(name, seed=seed, model_patch=(node, options), filename_prefix="offloaded")
    else:
        workflow = txt2img_workflow(name, seed=seed, filename_prefix="offloaded")
        workflow["1"] = {"class_type": node, "inputs": {"unet_name": name, "weight_dtype": "default", **options}}
    entry = comfy_server.run(with_report(workflow))
    assert np.array_equal(pixels(comfy_server, entry), pixels(comfy_server, plain))
    stats = report_of(entry)
    assert stats["bytes_d2h"] == 0 and stats["final"] is True
    streamed = stats["groups"] - stats["resident_groups"]
    assert stats["streamed_bytes_per_pass"] > 0 and streamed > 0
    assert stats["copies_h2d"] >= stats["steps"] * streamed


def test_lora_after_offload_through_the_api(comfy_server):
    name = comfy_server.models.unet_name
    make_lora(comfy_server.models.models_dir / "diffusion_models" / name,
              comfy_server.models.models_dir / "loras" / "api_lora.safetensors")
    lora = {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": "api_lora.safetensors", "strength_model": 0.7}}
    plain = txt2img_workflow(name, seed=31, filename_prefix="lora_plain")
    plain["11"] = {**lora, "inputs": {**lora["inputs"], "model": ["1", 0]}}
    plain["6"]["inputs"]["model"] = ["11", 0]
    offloaded = txt2img_workflow(name, seed=31, model_patch=("GroupOffload", OFFLOAD), filename_prefix="lora_off")
    offloaded["11"] = {**lora, "inputs": {**lora["inputs"], "model": ["10", 0]}}
    offloaded["6"]["inputs"]["model"] = ["11", 0]
    assert np.array_equal(pixels(comfy_server, comfy_server.run(offloaded)),
                          pixels(comfy_server, comfy_server.run(plain)))


@pytest.mark.parametrize("field, value, message", [
    ("residency", "sometimes", "residency"),
    ("prefetch", -1, "prefetch"),
    ("blocks_per_group", 0, "blocks_per_group"),
])
def test_bad_input_is_refused_in_comfyui_style(comfy_server, field, value, message):
    name = comfy_server.models.unet_name
    workflow = txt2img_workflow(name, seed=41, model_patch=("GroupOffload", OFFLOAD | {field: value}))
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(workflow)
    body = rejected.value.body
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert message in str(body["node_errors"]["10"])
    entry = comfy_server.run(txt2img_workflow(name, seed=42 + len(field), model_patch=("GroupOffload", OFFLOAD)))
    assert comfy_server.output_images(entry), "the next prompt works"


def test_execution_error_is_reported_and_the_server_keeps_running(comfy_server):
    name = comfy_server.models.unet_name
    workflow = with_report(txt2img_workflow(name, seed=51))  # the report on a model that is not offloaded
    entry = comfy_server.wait(comfy_server.queue(workflow), check=False)
    status = entry["status"]
    assert status["status_str"] == "error"
    error = next(m[1] for m in status["messages"] if m[0] == "execution_error")
    assert error["node_type"] == "GroupOffloadReport" and "needs a model from Group Offload" in error["exception_message"]
    assert comfy_server.output_images(comfy_server.run(txt2img_workflow(name, seed=52)))


def test_free_unloads_and_the_next_run_matches(comfy_server):
    name = comfy_server.models.unet_name
    offloaded = with_report(txt2img_workflow(name, seed=61, model_patch=("GroupOffload", OFFLOAD)))
    assert report_of(comfy_server.run(offloaded))["bytes_d2h"] == 0
    status, _ = comfy_server.post("/free", {"unload_models": True, "free_memory": True})
    assert status == 200
    offloaded["6"]["inputs"]["seed"] = 62
    second = comfy_server.run(offloaded)
    plain = comfy_server.run(txt2img_workflow(name, seed=62, filename_prefix="free_plain"))
    assert np.array_equal(pixels(comfy_server, second), pixels(comfy_server, plain))
    assert report_of(second)["bytes_d2h"] == 0
