"""The ComfyUI front end driven in Chromium (Playwright): a page on the live server, ready for the pack, and the
workflows built and run in it."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import ConsoleMessage, Page, sync_playwright

from testbed.comfy_boot import ARTIFACTS_DIR, PACK_DIR_NAME, REPO_ROOT
from testbed.live_server import ComfyServer, find_chromium

# The flags the machine notes give for a closed network: without the background-networking ones
# Chromium keeps trying to reach Google's hosts.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


PACK_URL = f"/extensions/{PACK_DIR_NAME}/"


# The front end asks for a node's help page in the user's language, docs/<node>/<locale>.md, before the
# fallback docs/<node>.md (web/docs has English as the fallback and Chinese as <node>/zh.md).
LOCALE_HELP_PAGE = re.compile(re.escape(PACK_URL) + r"docs/[^/]+/[a-zA-Z-]+\.md")
FRONTEND_VERSION = importlib.metadata.version("comfyui_frontend_package")
ARTIFACTS = ARTIFACTS_DIR / "browser" / f"frontend-{FRONTEND_VERSION}"  # one folder per ComfyUI version
SCREENSHOT = ARTIFACTS / "group_offload.png"


# GROUP_OFFLOAD_WRITE_SCREENSHOTS=1: the pictures of the help pages (web/docs) and the templates' thumbnails
# (example_workflows) are taken anew from this front end.
WRITE_SCREENSHOTS = os.environ.get("GROUP_OFFLOAD_WRITE_SCREENSHOTS") == "1"
DOCS_DIR = REPO_ROOT / "web" / "docs"
STEPS = 4
PAGE_TIMEOUT_MS = 120_000
RUN_TIMEOUT_MS = 240_000


# Settings of a user who has seen the first-run screens, so that no dialog covers the canvas and the
# frontend does not ask api.comfy.org for release notes.
USER_SETTINGS = {
    "Comfy.TutorialCompleted": True,
    "Comfy.InstalledVersion": FRONTEND_VERSION,
    "Comfy.Notification.ShowVersionUpdates": False,
    "Comfy.VueNodes.Enabled": False,  # the LiteGraph canvas, where onDrawForeground draws
}


# Loopback paths the frontend asks for that a correct install does not have:
LOOPBACK_404_IGNORED = {
    # index.html links a legacy stylesheet that no ComfyUI install ships.
    "/user.css",
    # Chromium asks every site for its icon; ComfyUI's frontend sets one from script and serves none here.
    "/favicon.ico",
}


@dataclass
class ConsoleLog:
    """Console errors, uncaught page errors and failed requests, with the environmental ones set apart."""

    errors: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)

    def on_console(self, message: ConsoleMessage) -> None:
        url = message.location.get("url", "")
        text = f"{message.text} [{url}]"
        if message.type == "error":
            (self.ignored if _is_environmental(message) else self.errors).append(text)
        elif message.type == "warning" and PACK_URL in url:
            self.errors.append(f"warning from this pack: {text}")

    def on_page_error(self, error) -> None:
        self.errors.append(f"uncaught: {error}")

    def on_request_failed(self, request) -> None:
        self.failed_requests.append(f"{request.method} {request.url}: {request.failure}")

    def on_response(self, response) -> None:
        """A rejected API call (ComfyUI answers 4xx/5xx with a JSON body that says why) is kept with its body."""
        if response.status >= 400 and "/api/" in response.url:
            self.failed_requests.append(f"{response.request.method} {response.url}: {response.status} {response.text()[:4000]}")

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors


def _is_loopback(url: str) -> bool:
    return urllib.parse.urlsplit(url).hostname in {"127.0.0.1", "localhost", "::1"}


def _settings_onchange_error(text: str) -> bool:
    """Frontend 1.32.x: useRenderModeSetting sets 'LiteGraph.Canvas.MinFontSizeForLOD' before the core
    settings are registered, and the setting store's onChange reads the id of the missing definition
    ("Cannot read properties of undefined (reading 'id')" at onChange < Proxy.set < load in GraphView-*.js)."""
    return (text.startswith("TypeError: Cannot read properties of undefined (reading 'id')")
            and re.search(r"at onChange .*\n\s+at Proxy\.set .*\n(?:.*\n)*?\s+at load \(.*/GraphView-[^/]*\.js", text) is not None)


def _graph_before_initialization_error(text: str) -> bool:
    """Frontend 1.49.x: its own start-up reads ``app.rootGraph`` before the graph exists, which logs this."""
    return text == "ComfyApp graph accessed before initialization"


FRONTEND_RELEASE = ".".join(FRONTEND_VERSION.split(".")[:2])
# The frontend's own start-up errors, by frontend release ("major.minor"): each is logged on every
# page load, also with --disable-all-custom-nodes, so it says nothing about this pack.
FRONTEND_STARTUP_ERRORS: dict[str, Callable[[str], bool]] = {
    "1.32": _settings_onchange_error,
    "1.49": _graph_before_initialization_error,
}


def _is_environmental(message: ConsoleMessage) -> bool:
    """The console errors these tests ignore; each is named and explained here.

    1. "Failed to load resource" for a host other than loopback: the machine has no network; the
       frontend and Chromium may still try (the settings above stop the release-notes request).
    2. "Failed to load resource" 404 for a path of LOOPBACK_404_IGNORED, or for a help page in a language
       the pack has none in (LOCALE_HELP_PAGE): the front end then shows the fallback page.
    3. The start-up error of the frontend release in use, from FRONTEND_STARTUP_ERRORS.
    """
    url = message.location.get("url", "")
    text = message.text
    if text.startswith("Failed to load resource"):
        if not _is_loopback(url):
            return True
        path = urllib.parse.urlsplit(url).path
        return "404" in text and (path in LOOPBACK_404_IGNORED or LOCALE_HELP_PAGE.fullmatch(path) is not None)
    known_startup_error = FRONTEND_STARTUP_ERRORS.get(FRONTEND_RELEASE)
    return known_startup_error is not None and known_startup_error(text)


def _prepare_user(server: ComfyServer) -> None:
    """The user data of a user who has used ComfyUI before: settings, and the files and folders the
    frontend reads at start (a fresh user directory answers 404 for each, which the console logs)."""
    status, body = server.post("/settings", USER_SETTINGS)
    assert status == 200, body
    for name, content in (("user.css", b""), ("comfy.templates.json", b"[]")):
        request = urllib.request.Request(f"{server.url}/api/userdata/{name}?overwrite=true", data=content, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    for folder in ("workflows", "subgraphs"):
        (server.base_dir / "user" / "default" / folder).mkdir(parents=True, exist_ok=True)


READY_JS = """
() => {
    const app = window.comfyAPI?.app?.app;
    let names;
    try {
        names = app?.extensions?.map((e) => e.name) ?? [];
    } catch {
        return false;  // frontend 1.49 throws from app.extensions until its stores exist
    }
    // After set-up the frontend loads its first workflow, which would replace a graph
    // built before it: wait until that workflow is the active one.
    return app?.canvas && window.LiteGraph?.registered_node_types?.GroupOffloadReport
        && names.includes("GroupOffload.Telemetry") && names.includes("GroupOffload.Report")
        && app.extensionManager?.workflow?.activeWorkflow != null;
}
"""


def wait_until_ready(page: Page) -> None:
    """Until the front end has loaded, with this pack's extensions registered and its first workflow open."""
    page.wait_for_function(READY_JS, timeout=PAGE_TIMEOUT_MS)


@dataclass
class BrowserPage:
    page: Page
    console: ConsoleLog


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        reason = "Chromium is not installed: `apt-get install -y chromium` (Debian) puts it at /usr/bin/chromium"
        print(f"SKIPPED browser tests: {reason}")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def browser_page(chromium: str, comfy_server: ComfyServer) -> Iterator[BrowserPage]:
    """The ComfyUI frontend, loaded with this pack's extensions registered."""
    _prepare_user(comfy_server)
    console = ConsoleLog()
    with tempfile.TemporaryDirectory(prefix="group-offload-chromium-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1600, "height": 1000}, device_scale_factor=1)
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("console", console.on_console)
            page.on("pageerror", console.on_page_error)
            page.on("requestfailed", console.on_request_failed)
            page.on("response", console.on_response)
            # The "Introducing Nodes 2.0" banner is dismissed in local storage.
            page.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
            page.goto(comfy_server.url, timeout=PAGE_TIMEOUT_MS)
            wait_until_ready(page)
            yield BrowserPage(page, console)
        finally:
            context.close()


@dataclass
class Workflow:
    """Nodes as ``key: (type, [x, y], {widget: value})`` and links as ``(from, output, to, input)``."""

    nodes: dict[str, tuple[str, list[int], dict]]
    links: list[tuple[str, str, str, str]]


def _sampling_nodes(model_key: str, steps: int, x: int) -> dict[str, tuple[str, list[int], dict]]:
    conditioning = {"control_after_generate": "fixed", "tokens": 8, "joint_dim": 64}
    return {
        "positive": ("GroupOffloadTestConditioning", [x, 0], {"seed": 1, **conditioning}),
        "negative": ("GroupOffloadTestConditioning", [x, 200], {"seed": 2, **conditioning}),
        "latent": ("EmptySD3LatentImage", [x, 400], {"width": 64, "height": 64, "batch_size": 1}),
        "sampler": ("KSampler", [x + 360, 0], {
            "seed": 7, "control_after_generate": "fixed", "steps": steps, "cfg": 4.0, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0}),
    }


def _sampling_links(model_key: str) -> list[tuple[str, str, str, str]]:
    return [(model_key, "MODEL", "sampler", "model"), ("positive", "CONDITIONING", "sampler", "positive"),
            ("negative", "CONDITIONING", "sampler", "negative"), ("latent", "LATENT", "sampler", "latent_image"),
            (model_key, "MODEL", "report", "model"), ("sampler", "LATENT", "report", "samples")]


OFFLOAD_WIDGETS = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0}


def offload_workflow(unet: str, vae: str, steps: int) -> Workflow:
    """UNETLoader -> GroupOffload -> KSampler -> VAEDecode -> SaveImage, and the report (model from
    GroupOffload, samples from KSampler), laid out so that one screenshot shows it all."""
    return Workflow(
        nodes={
            "unet": ("UNETLoader", [20, 0], {"unet_name": unet, "weight_dtype": "default"}),
            "offload": ("GroupOffload", [20, 170], OFFLOAD_WIDGETS),
            **_sampling_nodes("offload", steps, x=420),
            "vae": ("VAELoader", [420, 560], {"vae_name": vae}),
            "decode": ("VAEDecode", [780, 320], {}),
            "save": ("SaveImage", [780, 420], {"filename_prefix": "browser_group_offload"}),
            "report": ("GroupOffloadReport", [1130, 60], {}),
        },
        links=[("unet", "MODEL", "offload", "model"), *_sampling_links("offload"),
               ("sampler", "LATENT", "decode", "samples"), ("vae", "VAE", "decode", "vae"),
               ("decode", "IMAGE", "save", "images")],
    )


def loader_workflow(unet: str, steps: int) -> Workflow:
    """Load Diffusion Model (Group Offload) -> KSampler -> the report."""
    return Workflow(
        nodes={
            "offload": ("GroupOffloadLoader", [20, 0], {"unet_name": unet, "weight_dtype": "default", **OFFLOAD_WIDGETS}),
            **_sampling_nodes("offload", steps, x=420),
            "report": ("GroupOffloadReport", [780, 340], {}),
        },
        links=_sampling_links("offload"),
    )


BUILD_WORKFLOW_JS = """
({ nodes, links }) => {
    const graph = window.comfyAPI.app.app.graph;
    graph.clear();
    const byKey = {};
    for (const [key, [type, pos, values]] of Object.entries(nodes)) {
        const node = window.LiteGraph.createNode(type);
        if (node == null) throw new Error(`no node type ${type}`);
        node.pos = pos;
        graph.add(node);
        for (const [name, value] of Object.entries(values)) {
            const widget = node.widgets?.find((w) => w.name === name);
            if (widget == null) throw new Error(`${type} has no widget ${name}`);
            widget.value = value;
        }
        byKey[key] = node;
    }
    for (const [from, output, to, input] of links) {
        if (byKey[from].connect(output, byKey[to], input) == null) throw new Error(`cannot link ${from}.${output} -> ${to}.${input}`);
    }
    const ids = Object.fromEntries(Object.entries(byKey).map(([key, node]) => [key, String(node.id)]));
    // As a saved workflow file holds it (JSON drops the undefined fields the schema rejects as null).
    return { ids, workflow: JSON.parse(JSON.stringify(graph.serialize())) };
}
"""


LOAD_AND_QUEUE_JS = """
async (workflow) => {
    const { app } = window.comfyAPI.app;
    const { api } = window.comfyAPI.api;
    await app.loadGraphData(workflow);
    app.canvas.ds.scale = 1;
    app.canvas.ds.offset = [70, 120];
    app.canvas.setDirty(true, true);
    const { output } = await app.graphToPrompt();
    const seen = { telemetry: [], executed: [], done: null };
    const listeners = {
        "group_offload.telemetry": ({ detail }) => seen.telemetry.push(detail),
        executed: ({ detail }) => seen.executed.push(detail.node),
        execution_success: ({ detail }) => { seen.done = { ok: true, ...detail }; },
        execution_error: ({ detail }) => { seen.done = { ok: false, ...detail }; },
    };
    for (const [event, listener] of Object.entries(listeners)) api.addEventListener(event, listener);
    seen.stop = () => { for (const [event, listener] of Object.entries(listeners)) api.removeEventListener(event, listener); };
    window.groupOffloadTestRun = seen;
    await app.queuePrompt(0, 1);
    return output;
}
"""


READ_STATE_JS = """
(ids) => {
    const graph = window.comfyAPI.app.app.graph;
    const offload = graph.getNodeById(ids.offload);
    const report = graph.getNodeById(ids.report);
    const rows = {};
    for (const row of document.querySelectorAll(".group-offload-report tr[data-field]")) {
        rows[row.dataset.field] = [row.querySelector("th").textContent, row.querySelector("td").textContent];
    }
    const element = document.querySelector(".group-offload-report");
    const box = element?.getBoundingClientRect();
    const run = window.groupOffloadTestRun;
    run.stop();
    return {
        telemetry: offload.groupOffloadTelemetry,
        report: report.groupOffloadReport,
        rows,
        reportText: element?.textContent ?? null,
        reportVisible: box != null && box.width > 0 && box.height > 0,
        run: { telemetry: run.telemetry, executed: run.executed, done: run.done },
    };
}
"""


NODE_IN_VIEW_JS = """
async (id) => {
    const { app } = window.comfyAPI.app;
    const node = app.graph.getNodeById(id);
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const canvas = app.canvas.canvas.getBoundingClientRect();
    app.canvas.ds.scale = 1;
    app.canvas.ds.offset = [320 - node.pos[0], 200 + title - node.pos[1]];
    app.canvas.setDirty(true, true);
    await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
    return { x: canvas.left + 320, y: canvas.top + 200, width: node.size[0], height: node.size[1] + title };
}
"""


def screenshot_node(page: Page, node_id: str, path: Path, margin: int = 6) -> None:
    """A picture of one node (title bar included), moved into the middle-left of the canvas at scale 1, clear
    of the front end's menus and notices."""
    box = page.evaluate(NODE_IN_VIEW_JS, node_id)
    clip = {"x": box["x"] - margin, "y": box["y"] - margin, "width": box["width"] + 2 * margin,
            "height": box["height"] + 2 * margin}
    page.screenshot(path=str(path), clip=clip)


def _save_artifact(name: str, data: object) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_text(json.dumps(data, indent=2))


def run_in_page(browser: BrowserPage, workflow: Workflow, name: str) -> tuple[dict, dict, dict]:
    """Build, load and queue ``workflow``; returns the node ids, the API prompt and the state after the run."""
    page = browser.page
    built = page.evaluate(BUILD_WORKFLOW_JS, asdict(workflow))
    ids = built["ids"]
    _save_artifact(f"{name}_workflow.json", built["workflow"])
    prompt = page.evaluate(LOAD_AND_QUEUE_JS, built["workflow"])
    page.wait_for_function("() => window.groupOffloadTestRun?.done != null", timeout=RUN_TIMEOUT_MS)
    page.wait_for_timeout(300)  # let the canvas draw the final figures
    state = page.evaluate(READ_STATE_JS, ids)
    _save_artifact(f"{name}_state.json", state)
    assert state["run"]["done"]["ok"], (state["run"]["done"], browser.console.failed_requests)
    return ids, prompt, state


def check_figures(ids: dict, state: dict, steps: int) -> None:
    # Live readout: the node keeps the last message, the final one.
    telemetry = state["telemetry"]
    assert telemetry is not None, "the offload node got no telemetry"
    assert telemetry["node_id"] == ids["offload"]
    assert telemetry["final"] is True
    assert telemetry["bytes_d2h"] == 0
    assert telemetry["streamed_groups"] == 2 and telemetry["resident_groups"] == 0
    assert telemetry["bytes_h2d"] > 0
    assert telemetry["steps"] == steps and len(telemetry["step_gbps"]) == steps
    messages = [m for m in state["run"]["telemetry"] if m["node_id"] == ids["offload"]]
    assert [m["final"] for m in messages].count(True) == 1 and messages[-1]["final"]
    assert messages[0]["final"] is False  # a live figure came before the final one

    # Report: the same figures, as a table in the DOM.
    assert state["report"] == telemetry
    assert ids["report"] in state["run"]["executed"]
    assert state["reportVisible"]
    assert state["rows"]["bytes_d2h"][1] == "0 B"
    assert state["rows"]["steps"][1] == str(steps)
    assert state["rows"]["groups"][1] == "2 (0 resident, 2 streamed)"
    assert state["rows"]["back_offs"][1] == "none"
    assert re.fullmatch(r"\d+(\.\d+)? (KB|MB|GB) in \d+ copies", state["rows"]["bytes_h2d"][1])
    assert ("in_place_bytes" in state["rows"]) == (telemetry["in_place_bytes"] > 0)  # the host budget's rows
    if telemetry["cpu_only"]:
        assert "offloading brings nothing" in state["reportText"]


def finish(page: Page, console: ConsoleLog, screenshot: Path, started: float) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(screenshot))
    print(f"\nbrowser run: {time.monotonic() - started:.1f} s from building the graph to the final figures; "
          f"screenshot {screenshot}")
    if console.ignored:
        print("ignored console errors (see _is_environmental):\n  " + "\n  ".join(e.splitlines()[0] for e in console.ignored))
        console.ignored.clear()
    assert console.take_errors() == [], f"failed requests: {console.failed_requests}"
