"""example_workflows/: every template loads in this ComfyUI (known nodes, valid widget values, well-typed links),
names the files it expects in a note, offloads every model it samples with, and runs headless through a real
server that holds tiny stand-ins under those file names (stand_ins: the text encoders are stood in for by
seeded conditioning, sizes shrink to 64 px and sampling to 2 steps, and every group streams: on a CPU,
``residency = auto`` keeps all of a tiny model resident). A template with ComfyUI-GGUF's loader runs where
``dev.py setup`` unpacked ComfyUI-GGUF, and is skipped elsewhere."""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest

from testbed import gguf_files
from testbed import stand_ins
from testbed.comfy_boot import TESTBED_DIR
from testbed.fixture_models import link_or_copy_dir
from testbed.live_server import ComfyServer
from testbed.ui_workflows import (
    FRONTEND_ONLY_NODES,
    MODE_BYPASS,
    Links,
    api_prompt,
    choices,
    example_workflows,
    load,
    note_text,
    widget_inputs,
    widget_values,
)

TEMPLATES = example_workflows()

# The inputs that name a user's file, and the folder it is in.
FILE_INPUTS = {"unet_name": "diffusion_models", "lora_name": "loras", "vae_name": "vae", "clip_name": "text_encoders",
               "clip_name1": "text_encoders", "clip_name2": "text_encoders", "image": "input"}
# Each file the templates name but the text encoders, and the stand-in the server writes under its name.
STAND_INS = {
    "diffusion_models/qwen_image_bf16.safetensors": "qwen_image",
    "diffusion_models/qwen_image_fp8_e4m3fn.safetensors": "qwen_image",
    "diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors": "qwen_image",
    "diffusion_models/qwen-image-Q4_K_M.gguf": "qwen_image_gguf",
    "diffusion_models/flux1-dev.safetensors": "flux",
    "diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "wan_t2v",
    "diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "wan_t2v",
    "loras/Qwen-Image-Lightning-8steps-V1.0.safetensors": "qwen_image_lora",
    "vae/qwen_image_vae.safetensors": "wan_vae",
    "vae/ae.safetensors": "flux_vae",
    "vae/wan_2.1_vae.safetensors": "wan_vae",
    "input/example.png": "image",
}
OFFLOAD_NODES = {"GroupOffload", "GroupOffloadLoader"}
SAMPLERS = {"KSampler", "KSamplerAdvanced"}
TEXT_ENCODERS = {"CLIPTextEncode", "CLIPTextEncodeFlux", "TextEncodeQwenImageEditPlus"}
TEXT_ENCODER_LOADERS = {"CLIPLoader", "DualCLIPLoader"}
BYPASSED_IN_HEADLESS_RUNS = {"FluxKontextImageScale"}  # it would scale the 64 px stand-in image to a megapixel
SMALL_SIZES = {"EmptySD3LatentImage": {"width": 64, "height": 64},
               "EmptyHunyuanLatentVideo": {"width": 64, "height": 64, "length": 1}}
STEPS = 2
STREAM_EVERY_GROUP = {"residency": "stream_all"}
GGUF_LOADERS = {"UnetLoaderGGUF", "UnetLoaderGGUFAdvanced"}  # ComfyUI-GGUF's


def template_id(path) -> str:
    return path.stem


def needs_comfyui_gguf(workflow: dict, comfy=None) -> None:
    """For a template with ComfyUI-GGUF's loader: skip without ComfyUI-GGUF, else load it into ``comfy`` (this
    process's ComfyUI) when given."""
    if not GGUF_LOADERS & {node["type"] for node in workflow["nodes"]}:
        return
    if gguf_files.comfyui_gguf_missing():
        pytest.skip(gguf_files.comfyui_gguf_missing())
    if comfy is not None:
        gguf_files.load_comfyui_gguf(comfy)


def files_named(workflow: dict, spec_of) -> list[str]:
    """``<folder>/<file name>`` of every file the workflow's running nodes name."""
    named = []
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY_NODES or node.get("mode", 0) != 0:
            continue
        for name, value in widget_values(node, spec_of(node["type"])).items():
            if name in FILE_INPUTS:
                named.append(f"{FILE_INPUTS[name]}/{value}")
    return named


def in_process_spec(comfy):
    return lambda class_type: comfy.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()


@pytest.mark.parametrize("path", TEMPLATES, ids=template_id)
def test_example_workflow_is_valid(comfy, path):
    workflow = load(path)
    needs_comfyui_gguf(workflow, comfy)
    by_id = {n["id"]: n for n in workflow["nodes"]}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY_NODES:
            continue
        node_class = comfy.NODE_CLASS_MAPPINGS.get(node["type"])
        assert node_class is not None, f"{node['type']} is not a registered node"
        spec = node_class.INPUT_TYPES()
        values = widget_values(node, spec)
        for name, entry in widget_inputs(spec):
            options = choices(entry)
            if options is not None and name not in FILE_INPUTS:
                assert values[name] in options, f"{node['type']}.{name} = {values[name]!r} is not one of its choices"
    for link_id, source, source_slot, target, target_slot, kind in workflow["links"]:
        source_class = comfy.NODE_CLASS_MAPPINGS[by_id[source]["type"]]
        assert source_class.RETURN_TYPES[source_slot] == kind, f"link {link_id} leaves a {kind} slot"
        target_input = by_id[target]["inputs"][target_slot]
        assert target_input["type"] == kind and target_input["link"] == link_id


@pytest.mark.parametrize("path", TEMPLATES, ids=template_id)
def test_example_workflow_names_its_files_in_a_note(comfy, path):
    workflow = load(path)
    needs_comfyui_gguf(workflow, comfy)
    notes = note_text(workflow)
    files = files_named(workflow, in_process_spec(comfy))
    assert files, "the workflow loads no file"
    missing = [f for f in files if f.split("/", 1)[1] not in notes]
    assert missing == [], f"the note does not name {missing}"


@pytest.mark.parametrize("path", TEMPLATES, ids=template_id)
def test_every_sampler_samples_an_offloaded_model(path):
    workflow = load(path)
    links = Links(workflow)
    samplers = [n for n in workflow["nodes"] if n["type"] in SAMPLERS]
    assert samplers
    for sampler in samplers:
        node = sampler
        while node is not None and node["type"] not in OFFLOAD_NODES:
            node = links.upstream(node, "model")
        assert node is not None, f"{sampler['type']} #{sampler['id']} samples a model that is not offloaded"


@pytest.mark.parametrize("path", TEMPLATES, ids=template_id)
def test_example_workflow_shows_the_host_memory_settings_with_a_note(comfy, path):
    workflow = load(path)
    needs_comfyui_gguf(workflow, comfy)
    for node in (n for n in workflow["nodes"] if n["type"] in OFFLOAD_NODES):
        saved = node["widgets_values"]
        assert len(saved) == len(widget_inputs(in_process_spec(comfy)(node["type"]))), (
            f"{node['type']} #{node['id']} saves {len(saved)} input values: a template shows every input's")
        assert widget_values(node, in_process_spec(comfy)(node["type"]))["host_memory"] == "auto"
    assert "`host_memory`" in note_text(workflow) and "`host_gb`" in note_text(workflow)


def test_qwen_example_uses_the_loader_and_the_model_card_cfg(comfy):
    workflow = load(next(p for p in TEMPLATES if p.stem == "qwen_image_group_offload"))
    types = {n["type"]: n for n in workflow["nodes"]}
    assert "GroupOffloadLoader" in types and "GroupOffloadReport" in types
    assert types["KSampler"]["widgets_values"][3] == 4.0
    assert types["CLIPLoader"]["widgets_values"][:2] == ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image"]


def test_wan_example_offloads_both_experts_as_comfyuis_template_wires_them():
    workflow = load(next(p for p in TEMPLATES if p.stem.startswith("wan2.2_t2v")))
    links = Links(workflow)
    samplers = sorted((n for n in workflow["nodes"] if n["type"] == "KSamplerAdvanced"), key=lambda n: n["widgets_values"][7])
    assert len(samplers) == 2
    (high, low) = samplers
    # add_noise, noise_seed, control, steps, cfg, sampler, scheduler, start_at_step, end_at_step, leftover noise
    assert [high["widgets_values"][i] for i in (0, 3, 7, 8, 9)] == ["enable", 20, 0, 10, "enable"]
    assert [low["widgets_values"][i] for i in (0, 3, 7, 8, 9)] == ["disable", 20, 10, 10000, "disable"]
    assert links.upstream(low, "latent_image") is high
    experts = []
    for sampler in (high, low):
        offload = links.upstream(links.upstream(sampler, "model"), "model")
        assert offload["type"] == "GroupOffload"
        experts.append(links.upstream(offload, "model")["widgets_values"][0])
    assert experts == ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"]


# --------------------------------------------------------------------------------------------
# Headless runs
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_in_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A real ComfyUI server whose folders hold the stand-ins of STAND_INS (the stand_in_models test pack)."""
    base_dir = tmp_path_factory.mktemp("stand_in_server")
    (base_dir / "custom_nodes").mkdir()
    link_or_copy_dir(TESTBED_DIR / "stand_in_models", base_dir / "custom_nodes" / "stand_in_models")
    if gguf_files.comfyui_gguf_missing() is None:
        gguf_files.link_comfyui_gguf(base_dir)
    with ComfyServer(base_dir, env={stand_ins.ENV: json.dumps(STAND_INS)}) as server:
        yield server


def headless_prompt(workflow: dict, object_info: dict) -> dict[str, dict]:
    """The workflow's prompt with the text encoders stood in for, at 64 px and 2 steps, every group streamed."""
    workflow = copy.deepcopy(workflow)
    for node in workflow["nodes"]:
        if node["type"] in BYPASSED_IN_HEADLESS_RUNS:
            node["mode"] = MODE_BYPASS
    spec_of = lambda class_type: object_info[class_type]["input"]  # noqa: E731
    kinds = {STAND_INS[f] for f in files_named(workflow, spec_of) if f.startswith("diffusion_models/")}
    (text_width,) = {stand_ins.TEXT_WIDTHS[kind] for kind in kinds}
    prompt = api_prompt(workflow, spec_of)
    for node_id, node in list(prompt.items()):
        inputs = node["inputs"]
        if node["class_type"] in TEXT_ENCODER_LOADERS:
            del prompt[node_id]
        elif node["class_type"] in TEXT_ENCODERS:
            prompt[node_id] = {"class_type": "GroupOffloadTestConditioning",
                               "inputs": {"seed": int(node_id), "tokens": 8, "joint_dim": text_width}}
        elif node["class_type"] in OFFLOAD_NODES:
            inputs.update(STREAM_EVERY_GROUP)
        elif node["class_type"] in SMALL_SIZES:
            inputs.update(SMALL_SIZES[node["class_type"]])
        elif node["class_type"] == "KSamplerAdvanced":
            scale = STEPS / inputs["steps"]
            inputs["start_at_step"] = round(inputs["start_at_step"] * scale)
            if inputs["end_at_step"] < inputs["steps"]:
                inputs["end_at_step"] = round(inputs["end_at_step"] * scale)
            inputs["steps"] = STEPS
        elif node["class_type"] == "KSampler":
            inputs["steps"] = STEPS
    return prompt


@pytest.mark.parametrize("path", TEMPLATES, ids=template_id)
def test_example_workflow_runs_headless_with_stand_ins(stand_in_server: ComfyServer, path):
    workflow = load(path)
    needs_comfyui_gguf(workflow)
    unknown = set(files_named(workflow, lambda t: stand_in_server.object_info[t]["input"])) - set(STAND_INS)
    assert {f.split("/")[0] for f in unknown} <= {"text_encoders"}, f"no stand-in for {unknown}"

    prompt = headless_prompt(workflow, stand_in_server.object_info)
    entry = stand_in_server.run(prompt, timeout=300)

    reports = [node_id for node_id, node in prompt.items() if node["class_type"] == "GroupOffloadReport"]
    assert reports
    for node_id in reports:
        (stats,) = entry["outputs"][node_id]["group_offload"]
        assert stats["groups"] > 0 and stats["streamed_groups"] == stats["groups"]
        assert stats["steps"] >= 1 and stats["bytes_h2d"] >= stats["steps"] * stats["bytes_per_step"] > 0
        assert stats["bytes_d2h"] == 0
    images = stand_in_server.output_images(entry)
    assert images and all(image.stat().st_size > 0 for image in images)
