"""web/docs/: the help pages ComfyUI's front end shows in a node's help panel instead of its description.

The front end (1.32 and 1.49 alike) asks for ``/extensions/<pack>/docs/<node>/<locale>.md`` first and then for
``/extensions/<pack>/docs/<node>.md``, and resolves a page's relative images against ``/extensions/<pack>/docs/``.
English is the fallback page, Chinese is ``<node>/zh.md``.
"""
from __future__ import annotations

import re
import urllib.request

import pytest

from testbed.comfy_boot import PACK_DIR_NAME, REPO_ROOT
from testbed.live_server import ComfyServer
from testbed.pack_modules import pack_module

DOCS = REPO_ROOT / "web" / "docs"
DOCS_URL = f"/extensions/{PACK_DIR_NAME}/docs/"
NODES = ["GroupOffload", "GroupOffloadCLIPLoader", "GroupOffloadLoader", "GroupOffloadReport", "GroupOffloadTextEncoder"]
PAGES = [(node, page) for node in NODES for page in (f"{node}.md", f"{node}/zh.md")]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def images(page: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (DOCS / page).read_text())


def fetch(server: ComfyServer, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(server.url + path, timeout=30) as response:
        return response.status, response.read()


def test_every_node_of_the_pack_has_its_pages(comfy):
    assert sorted(pack_module("nodes.offload_nodes").NODE_CLASS_MAPPINGS) == NODES
    assert all((DOCS / page).is_file() for _, page in PAGES)


@pytest.mark.parametrize("node, page", PAGES, ids=[page for _, page in PAGES])
def test_a_page_documents_every_input_of_its_node(comfy, node, page):
    spec = pack_module("nodes.offload_nodes").NODE_CLASS_MAPPINGS[node].INPUT_TYPES()
    text = (DOCS / page).read_text()
    undocumented = [name for name in [*spec["required"], *spec.get("optional", {})] if f"`{name}`" not in text]
    assert undocumented == []
    if "residency" in spec["required"]:
        assert all(f"`{mode}`" in text for mode in ("auto", "stream_all", "budget"))
        assert "prefetch + 1" in text and "MAX_PINNED_MEMORY" in text


@pytest.mark.parametrize("node, page", PAGES, ids=[page for _, page in PAGES])
def test_the_server_serves_each_page_and_its_images_where_the_front_end_asks(comfy_server: ComfyServer, node, page):
    status, body = fetch(comfy_server, DOCS_URL + page)
    assert status == 200 and body.decode() == (DOCS / page).read_text()
    for image in images(page):
        assert "/" not in image, "the front end resolves images against docs/, whichever page names them"
        status, body = fetch(comfy_server, DOCS_URL + image)
        assert status == 200 and body.startswith(PNG_SIGNATURE), image


def test_the_report_pages_explain_every_row_of_the_reports_table():
    """The rows as web/group_offload_report.js labels them (the table is English in every language)."""
    labels = re.findall(r'^\s*\["\w+", "([^"]+)"', (REPO_ROOT / "web" / "group_offload_report.js").read_text(), re.M)
    assert len(labels) >= 10
    for page in ("GroupOffloadReport.md", "GroupOffloadReport/zh.md"):
        text = (DOCS / page).read_text()
        assert [label for label in labels if f"**{label}**" not in text] == [], page
