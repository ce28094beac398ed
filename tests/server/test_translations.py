"""locales/zh/nodeDefs.json: Chinese names, tooltips and descriptions for every node, input and output of the
pack, in the format ComfyUI's front end reads (``nodeDefs.<node>.inputs.<input>.name``), served by ComfyUI's
``GET /i18n``, which merges the ``locales/`` of every custom node."""
from __future__ import annotations

import json

from testbed.comfy_boot import REPO_ROOT
from testbed.live_server import ComfyServer
from testbed.pack_modules import pack_module

NODE_DEFS = REPO_ROOT / "locales" / "zh" / "nodeDefs.json"


def pack_nodes() -> dict:
    return pack_module("nodes.offload_nodes").NODE_CLASS_MAPPINGS


def test_i18n_serves_the_packs_chinese_strings(comfy_server: ComfyServer):
    served = comfy_server.get("/i18n")["zh"]["nodeDefs"]
    ours = json.loads(NODE_DEFS.read_text())
    assert {name: served.get(name) for name in ours} == ours
    assert served["GroupOffload"]["display_name"] == "分组卸载（无回拷）"


def test_every_node_input_and_output_has_a_chinese_name_and_tooltip(comfy):
    translations = json.loads(NODE_DEFS.read_text())
    nodes = pack_nodes()
    assert set(translations) == set(nodes)
    for name, node_class in nodes.items():
        translated = translations[name]
        assert translated["display_name"] and translated["description"], name
        spec = node_class.INPUT_TYPES()
        inputs = [*spec.get("required", {}), *spec.get("optional", {})]
        assert list(translated["inputs"]) == inputs, f"{name}: translated inputs differ from the node's"
        for input_name, strings in translated["inputs"].items():
            assert strings.get("name") and strings.get("tooltip"), f"{name}.{input_name}"
        assert list(translated["outputs"]) == [str(i) for i in range(len(node_class.RETURN_TYPES))]
        assert all(output.get("name") and output.get("tooltip") for output in translated["outputs"].values())
