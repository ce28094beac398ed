"""GGUF models that cannot run, through a real ComfyUI server with ComfyUI-GGUF: Unet Loader (GGUF) -> Group
Offload -> KSampler. Each fails as one clear node error, the server keeps running, and nothing stays pinned
(the server pins through the CUDA-runtime stand-in, as on a GPU machine; see ``fake_cudart``).

- a ``.gguf`` file cut short: ComfyUI-GGUF's loader fails on it before the model reaches Group Offload;
- a ``.gguf`` file cut short under a model that streams from it: the next run fails before a page past its
  end is read, and runs again once the file is whole;
- a tensor type ComfyUI-GGUF does not dequantize (``gguf_files.UNKNOWN_TYPE``): the model streams, and
  sampling fails at KSampler with ComfyUI-GGUF's own error, as without Group Offload, its pins given back;
- a weight that is a tensor subclass its bytes and attributes cannot rebuild (neither ComfyUI-GGUF's kind nor
  a wrapper subclass): Group Offload refuses it, naming the weight, its class and why
  (``GroupOffloadTestPlainSubclass`` makes one).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import gguf_files
from testbed.live_server import ComfyServer, txt2img_workflow

pytestmark = pytest.mark.skipif(gguf_files.comfyui_gguf_missing() is not None,
                                reason=gguf_files.comfyui_gguf_missing() or "")

OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}
IN_PLACE = OFFLOAD | {"host_memory": "budget", "host_gb": 0.0}  # every group streams from the file's pages
VALID = "tiny_qwen_image_Q8_0.gguf"


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A server with ComfyUI-GGUF and a valid tiny Q8_0 Qwen-Image (``VALID``) among its diffusion models."""
    base_dir = tmp_path_factory.mktemp("gguf_server")
    gguf_files.link_comfyui_gguf(base_dir)
    gguf_files.write_tiny_gguf(diffusion_models(base_dir) / VALID)
    with ComfyServer(base_dir, env={"GROUP_OFFLOAD_FAKE_CUDART": "1"}, classic_cache=True) as server:
        yield server


def diffusion_models(base_dir: Path) -> Path:
    return base_dir / "models" / "diffusion_models"


def gguf_prompt(name: str, seed: int, options: dict = OFFLOAD, between: tuple[str, dict] | None = None) -> dict:
    """UnetLoaderGGUF -> [between] -> GroupOffload -> KSampler -> VAEDecode -> SaveImage."""
    prompt = txt2img_workflow(name, seed=seed, model_patch=("GroupOffload", options))
    prompt["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}
    if between is not None:
        class_type, inputs = between
        prompt["11"] = {"class_type": class_type, "inputs": {**inputs, "model": ["1", 0]}}
        prompt["10"]["inputs"]["model"] = ["11", 0]
    return prompt


def served_pins(server: ComfyServer) -> int:
    pins = server.get("/group_offload_test/pins")
    assert pins["registered_bytes"] == pins["total_pinned"]
    return pins["registered_bytes"]


def node_error(server: ComfyServer, prompt: dict) -> dict:
    """The execution error of ``prompt``, which must fail, and that it left nothing more pinned (what it
    unloaded may have given its pins back)."""
    pinned = served_pins(server)
    entry = server.wait(server.queue(prompt), check=False)
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors, f"the prompt ran: {json.dumps(entry['status'])[:2000]}"
    assert served_pins(server) <= pinned, "the failed prompt left memory pinned"
    return errors[0]


def assert_the_server_runs_on(server: ComfyServer, seed: int) -> None:
    """A plain safetensors model still samples through Group Offload on the same server."""
    entry = server.run(txt2img_workflow(server.models.unet_name, seed=seed, model_patch=("GroupOffload", OFFLOAD)))
    assert server.output_images(entry)


def test_a_gguf_file_cut_short_fails_at_its_loader(gguf_server: ComfyServer):
    name = "cut_short.gguf"
    whole = (diffusion_models(gguf_server.base_dir) / VALID).read_bytes()
    (diffusion_models(gguf_server.base_dir) / name).write_bytes(whole[: len(whole) * 3 // 5])
    error = node_error(gguf_server, gguf_prompt(name, seed=1))
    assert error["node_type"] == "UnetLoaderGGUF", "ComfyUI-GGUF cannot read it: Group Offload never gets a model"
    assert_the_server_runs_on(gguf_server, seed=2)


def test_a_tensor_type_comfyui_gguf_does_not_dequantize_fails_at_the_sampler_as_without_the_node(
        gguf_server: ComfyServer):
    name, weight = "unknown_type.gguf", "transformer_blocks.0.img_mlp.net.2.weight"
    converter = gguf_files.converter_policy(gguf_files.QType.Q8_0)
    gguf_files.write_tiny_gguf(diffusion_models(gguf_server.base_dir) / name, policy=lambda key, tensor: (
        gguf_files.UNKNOWN_TYPE if key == weight else converter(key, tensor)))

    plain = gguf_prompt(name, seed=3)
    plain["6"]["inputs"]["model"] = ["1", 0]  # ComfyUI-GGUF alone fails only once it samples (its model loaded)
    alone = node_error(gguf_server, plain)
    assert alone["node_type"] == "KSampler" and gguf_files.UNKNOWN_TYPE.name in alone["exception_message"]

    error = node_error(gguf_server, gguf_prompt(name, seed=4))
    assert error["node_type"] == "KSampler"
    assert (error["exception_type"], error["exception_message"]) == (alone["exception_type"],
                                                                     alone["exception_message"])
    assert_the_server_runs_on(gguf_server, seed=5)


def test_a_weight_of_another_tensor_subclass_is_refused_by_name(gguf_server: ComfyServer):
    name = "plain_subclass.gguf"  # a model of its own: the test node changes one of its weights for good
    shutil.copyfile(diffusion_models(gguf_server.base_dir) / VALID, diffusion_models(gguf_server.base_dir) / name)
    error = node_error(gguf_server, gguf_prompt(name, seed=6, between=("GroupOffloadTestPlainSubclass", {})))
    assert error["node_type"] == "GroupOffload" and error["exception_type"].endswith(".UnpackableTensorError")
    message = error["exception_message"]
    assert "img_mod.1.weight is a PlainSubclass, " in message  # (the block's first Linear, the one it changed)
    assert "its attribute scale is a tensor" in message and "\n" not in message.rstrip("\n")
    assert_the_server_runs_on(gguf_server, seed=7)


def test_a_gguf_file_cut_short_under_its_streaming_model_fails_the_next_run_only(gguf_server: ComfyServer):
    """Last here: were a page past the file's end ever read, the server would die of SIGBUS."""
    name = "cut_short_later.gguf"
    path = diffusion_models(gguf_server.base_dir) / name
    shutil.copyfile(diffusion_models(gguf_server.base_dir) / VALID, path)
    whole = path.read_bytes()
    prompt = lambda seed: gguf_prompt(name, seed=seed, options=IN_PLACE)  # noqa: E731
    assert gguf_server.output_images(gguf_server.run(prompt(8)))
    with open(path, "r+b") as file:
        file.truncate(len(whole) // 2)
    error = node_error(gguf_server, prompt(9))
    assert error["node_type"] == "KSampler" and error["exception_type"].endswith("SourceChangedError")
    assert error["exception_message"].startswith(f"{name} is now {len(whole) // 2} bytes on disk")
    with open(path, "r+b") as file:
        file.write(whole)
    error = node_error(gguf_server, prompt(10))
    assert error["exception_message"].startswith(f"{name} was written to since the offloaded model mapped it")
    again = gguf_prompt(name, seed=11, options=IN_PLACE | {"prefetch": 0})  # a changed input: the handle built again
    assert gguf_server.output_images(gguf_server.run(again))
