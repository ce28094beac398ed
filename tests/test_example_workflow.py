"""example_workflows/ must load in ComfyUI: known nodes, valid widget values, well-typed links."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKFLOWS = sorted((Path(__file__).resolve().parents[1] / "example_workflows").glob("*.json"))
FILE_INPUTS = {"unet_name", "clip_name", "vae_name"}  # users' files: any name is valid here


def widget_inputs(node_class) -> list[tuple[str, tuple]]:
    """The inputs the front end shows as widgets, in order (KSampler's seed adds control_after_generate)."""
    spec = node_class.INPUT_TYPES()
    widgets = []
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            kind = entry[0]
            if isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                widgets.append((name, entry))
                if name in ("seed", "noise_seed"):
                    widgets.append(("control_after_generate", (["fixed", "increment", "decrement", "randomize"],)))
    return widgets


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_example_workflow_is_valid(comfy, path):
    workflow = json.loads(path.read_text())
    by_id = {n["id"]: n for n in workflow["nodes"]}
    for node in workflow["nodes"]:
        node_class = comfy.NODE_CLASS_MAPPINGS.get(node["type"])
        assert node_class is not None, f"{node['type']} is not a registered node"
        widgets = widget_inputs(node_class)
        values = node.get("widgets_values", [])
        assert len(values) == len(widgets), f"{node['type']}: {len(values)} widget values for {len(widgets)} widgets"
        for (name, entry), value in zip(widgets, values):
            if isinstance(entry[0], list) and name not in FILE_INPUTS:
                assert value in entry[0], f"{node['type']}.{name} = {value!r} is not one of its choices"
    for link_id, source, source_slot, target, target_slot, kind in workflow["links"]:
        source_class = comfy.NODE_CLASS_MAPPINGS[by_id[source]["type"]]
        assert source_class.RETURN_TYPES[source_slot] == kind, f"link {link_id} leaves a {kind} slot"
        target_input = by_id[target]["inputs"][target_slot]
        assert target_input["type"] == kind and target_input["link"] == link_id


def test_qwen_example_uses_the_loader_and_the_model_card_cfg(comfy):
    workflow = json.loads((WORKFLOWS[0].parent / "qwen_image_group_offload.json").read_text())
    types = {n["type"]: n for n in workflow["nodes"]}
    assert "GroupOffloadLoader" in types and "GroupOffloadReport" in types
    assert types["KSampler"]["widgets_values"][3] == 4.0
    assert types["CLIPLoader"]["widgets_values"][:2] == ["qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image"]
