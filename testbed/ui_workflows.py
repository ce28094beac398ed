"""UI-format workflows (what the front end saves and ``example_workflows/`` holds), read as the front end reads them.

A node's ``widgets_values`` hold one value per widget, in the order of its inputs, with the widgets the front
end adds itself (``control_after_generate`` after a seed, ``upload`` after an image choice). An input spec is
what ``INPUT_TYPES()`` returns or what ``/object_info`` lists as ``input``: both have the same shape.
:func:`api_prompt` turns a workflow into the API-format prompt that the front end's ``graphToPrompt`` queues.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXAMPLE_WORKFLOWS = Path(__file__).resolve().parents[1] / "example_workflows"

# Nodes of the front end alone: saved in workflows, never sent to the server.
FRONTEND_ONLY_NODES = {"Note", "MarkdownNote"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_NAMES = {"seed", "noise_seed"}
MODE_BYPASS = 4  # LiteGraph's node modes: 0 runs, 2 is muted, 4 is bypassed
FRONTEND_WIDGETS = {"control_after_generate", "upload"}  # saved with the node, not sent in the prompt

InputSpec = dict[str, dict[str, Any]]


def example_workflows() -> list[Path]:
    return sorted(EXAMPLE_WORKFLOWS.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def choices(entry: tuple | list) -> list | None:
    """The choices of a combo input (V1 lists them first, V3 as ``options``), else None."""
    kind = entry[0]
    if isinstance(kind, list):
        return kind
    options = entry[1] if len(entry) > 1 else {}
    return options.get("options") if kind == "COMBO" else None


def widget_inputs(spec: InputSpec) -> list[tuple[str, tuple | list]]:
    """The node's widgets in the order its ``widgets_values`` hold them, each with its input entry."""
    widgets = []
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            options = entry[1] if len(entry) > 1 else {}
            if not (choices(entry) is not None or entry[0] in WIDGET_TYPES) or options.get("forceInput"):
                continue
            widgets.append((name, entry))
            if entry[0] == "INT" and options.get("control_after_generate", name in SEED_NAMES):
                widgets.append(("control_after_generate", (["fixed", "increment", "decrement", "randomize"],)))
            if options.get("image_upload"):
                widgets.append(("upload", ("IMAGEUPLOAD",)))
    return widgets


def widget_values(node: dict, spec: InputSpec) -> dict[str, Any]:
    """``{widget name: value}`` of a saved node. Optional widgets past its saved values (inputs added since the
    workflow was saved) have their defaults, as the front end loads them."""
    values = node.get("widgets_values") or []
    widgets = widget_inputs(spec)
    added = widgets[len(values):]
    if len(values) > len(widgets) or any(name not in spec.get("optional", {}) for name, _ in added):
        raise ValueError(f"{node['type']} #{node['id']}: {len(values)} widget values for {len(widgets)} widgets "
                         f"({', '.join(name for name, _ in widgets)})")
    return {name: value for (name, _), value in zip(widgets, values)} | {name: entry[1]["default"] for name, entry in added}


class Links:
    """The workflow's links by id: ``(origin node id, origin slot, type)``."""

    def __init__(self, workflow: dict):
        self.nodes = {node["id"]: node for node in workflow["nodes"]}
        self.by_id = {link[0]: (link[1], link[2], link[5]) for link in workflow["links"]}

    def source(self, link_id: int) -> tuple[dict, int, str]:
        """The node and slot a link comes from, through bypassed nodes as the front end resolves them: a
        bypassed node passes on its input of the output's type (the same slot first)."""
        origin, slot, kind = self.by_id[link_id]
        node = self.nodes[origin]
        while node.get("mode", 0) == MODE_BYPASS:
            inputs = node.get("inputs", [])
            same_slot = [inputs[slot]] if slot < len(inputs) else []
            passed = next(i for i in same_slot + inputs if i["type"] == kind and i.get("link") is not None)
            origin, slot, kind = self.by_id[passed["link"]]
            node = self.nodes[origin]
        return node, slot, kind

    def upstream(self, node: dict, input_name: str) -> dict | None:
        """The node feeding ``node``'s input ``input_name``, or None when it is not linked."""
        linked = next((i for i in node.get("inputs", []) if i["name"] == input_name and i.get("link") is not None), None)
        return None if linked is None else self.source(linked["link"])[0]


def api_prompt(workflow: dict, spec_of: Callable[[str], InputSpec]) -> dict[str, dict]:
    """The API-format prompt of a UI-format workflow: running nodes only, widget values and links as inputs."""
    links = Links(workflow)
    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY_NODES or node.get("mode", 0) != 0:
            continue
        inputs = {name: value for name, value in widget_values(node, spec_of(node["type"])).items()
                  if name not in FRONTEND_WIDGETS}
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                source, source_slot, _ = links.source(slot["link"])
                inputs[slot["name"]] = [str(source["id"]), source_slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def note_text(workflow: dict) -> str:
    """The text of the workflow's notes."""
    return "\n".join(str(value) for node in workflow["nodes"] if node["type"] in FRONTEND_ONLY_NODES
                     for value in node.get("widgets_values") or [])
