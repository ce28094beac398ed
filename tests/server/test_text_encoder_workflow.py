"""A Qwen-Image-shaped workflow through the real server, its text encoder and its DiT both offloaded (issue 46):
a prompt change at every run, so that ComfyUI switches between the text encoder and the diffusion model each time;
the images are those of the same workflow without the pack, nothing is copied back, and after /free nothing of
either model is left: no handle, no host mirror, no pin."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from testbed import text_encoders
from testbed.fixture_models import link_or_copy
from testbed.live_server import txt2img_workflow

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
PROMPTS = ["a photograph of a cat", "a lighthouse at dusk", "a bowl of ramen, steam rising", "a red bicycle"]
LIVE = "90"


@pytest.fixture(scope="module")
def text_encoder_name(comfy_server) -> str:
    source = text_encoders.text_encoder_file("qwen25_7b")
    link_or_copy(source, comfy_server.models.models_dir / "text_encoders" / source.name)
    return source.name


def workflow(server, text_encoder: str, prompt: str, *, offloaded: bool, seed: int = 5) -> dict:
    """UNETLoader [-> Group Offload] and CLIPLoader [-> Group Offload (text encoder)] -> CLIPTextEncode (the prompt,
    and an empty negative) -> KSampler -> VAEDecode -> SaveImage."""
    flow = txt2img_workflow(server.models.unet_name, seed=seed, filename_prefix="te_workflow",
                            model_patch=("GroupOffload", OFFLOAD) if offloaded else None)
    flow["20"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": text_encoder, "type": "qwen_image"}}
    clip = ["20", 0]
    if offloaded:
        flow["21"] = {"class_type": "GroupOffloadTextEncoder", "inputs": {"clip": clip, **OFFLOAD}}
        clip = ["21", 0]
    flow["3"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": prompt}}
    flow["4"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": ""}}
    return flow


def live(server, flow: dict | None = None, **inputs) -> dict:
    flow = dict(flow or {})
    flow[LIVE] = {"class_type": "GroupOffloadTestLiveObjects", "inputs": inputs}
    return server.run(flow)["outputs"][LIVE]["live"][0]


def pixels(server, entry: dict) -> np.ndarray:
    (path,) = server.output_images(entry)
    return np.asarray(Image.open(path))


def test_prompt_changes_switch_between_the_offloaded_text_encoder_and_dit(comfy_server, text_encoder_name):
    expected = [pixels(comfy_server, comfy_server.run(workflow(comfy_server, text_encoder_name, p, offloaded=False)))
                for p in PROMPTS]
    assert not np.array_equal(expected[0], expected[1]), "the prompt changed nothing"
    for round_ in range(2):
        for prompt, image in zip(PROMPTS, expected):
            flow = workflow(comfy_server, text_encoder_name, prompt, offloaded=True)
            flow[LIVE] = {"class_type": "GroupOffloadTestLiveObjects", "inputs": {"samples": ["6", 0]}}
            entry = comfy_server.run(flow)
            assert np.array_equal(pixels(comfy_server, entry), image), f"round {round_}, {prompt!r}"
            counts = entry["outputs"][LIVE]["live"][0]
            assert counts["handles"] == 2 and counts["offload_patchers"] == 2  # the text encoder's and the DiT's
            assert counts["registered_bytes"] > 0
    assert comfy_server.post("/free", {"unload_models": True, "free_memory": True})[0] == 200
    nothing = {"handles": 0, "host_mirrors": 0, "host_mirror_bytes": 0, "onloaded_groups": 0, "registered_bytes": 0,
               "offload_patchers": 0}
    for _ in range(20):  # (the flags are handled between prompts)
        counts = live(comfy_server)
        if all(counts[key] == 0 for key in nothing):
            break
    assert {key: counts[key] for key in nothing} == nothing


def test_a_text_encoder_the_node_cannot_stream_fails_its_prompt_clearly_and_the_server_goes_on(comfy_server,
                                                                                                text_encoder_name):
    """A umt5 whose embedding holds most of its weights (no trunk of layers to stream): the node's error names the
    class and what to do, and the next prompt runs."""
    narrow = {**text_encoders.ENCODERS["umt5_xxl"].tiny, "d_ff": 128}
    source = text_encoders.cached_fixture("tiny_te_umt5_narrow", text_encoders.make_text_encoder, encoder="umt5_xxl",
                                          widths=narrow)
    link_or_copy(source, comfy_server.models.models_dir / "text_encoders" / source.name)
    flow = workflow(comfy_server, source.name, PROMPTS[0], offloaded=True)
    flow["20"]["inputs"]["type"] = "wan"
    entry = comfy_server.wait(comfy_server.queue(flow), check=False)
    assert entry["status"]["status_str"] == "error"
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["node_type"] == "GroupOffloadTextEncoder"
    assert "WanTEModel" in error["exception_message"] and "without Group Offload (text encoder)" in error["exception_message"]
    assert comfy_server.run(workflow(comfy_server, text_encoder_name, PROMPTS[1], offloaded=True))["status"]["completed"]
