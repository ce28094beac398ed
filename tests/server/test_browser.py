"""The pack's front end (web/) in the real ComfyUI frontend, in headless Chromium driven by Playwright.

A real ComfyUI server (``comfy_server``) serves its own frontend package with this pack installed.
The page builds a UI-format workflow through LiteGraph, loads it with ``app.loadGraphData``, queues
it with ``app.queuePrompt`` and waits for ``execution_success``; the tests then read what the
extensions keep on the nodes (``node.groupOffloadTelemetry``, ``node.groupOffloadReport``), the
report table in the DOM, and every console error the page logged.

Chromium is the system one (Debian's ``chromium`` package; ``live_server.find_chromium``): nothing
is downloaded. Without it the tests are skipped, saying so.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import re

import pytest

from testbed.live_server import ComfyServer
from testbed.browser import browser_page, chromium  # noqa: F401  (fixtures)
from testbed.browser import (
    ARTIFACTS,
    BUILD_WORKFLOW_JS,
    BrowserPage,
    DOCS_DIR,
    OFFLOAD_WIDGETS,
    PACK_URL,
    SCREENSHOT,
    STEPS,
    WRITE_SCREENSHOTS,
    check_figures,
    finish,
    run_in_page,
    loader_workflow,
    offload_workflow,
    screenshot_node,
)

pytestmark = pytest.mark.browser


# --------------------------------------------------------------------------------------------
# Console errors
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Workflows, built in the page through LiteGraph and loaded back as UI-format JSON
# --------------------------------------------------------------------------------------------


def test_live_readout_and_report_of_a_queued_workflow(browser_page: BrowserPage, comfy_server: ComfyServer):
    started = time.monotonic()
    workflow = offload_workflow(comfy_server.models.unet_name, comfy_server.models.vae_name, STEPS)
    ids, prompt, state = run_in_page(browser_page, workflow, "group_offload")

    # The loaded UI workflow is the prompt the test bed's API-format workflows describe.
    assert prompt[ids["offload"]]["class_type"] == "GroupOffload"
    host_defaults = {"host_memory": "auto", "host_gb": 0}  # optional widgets: the front end sends their defaults
    assert prompt[ids["offload"]]["inputs"] == {**OFFLOAD_WIDGETS, **host_defaults, "model": [ids["unet"], 0]}
    assert prompt[ids["sampler"]]["inputs"]["model"] == [ids["offload"], 0]
    assert prompt[ids["sampler"]]["inputs"]["steps"] == STEPS
    assert prompt[ids["report"]]["inputs"] == {"model": [ids["offload"], 0], "samples": [ids["sampler"], 0]}
    assert prompt[ids["positive"]]["inputs"] == {"seed": 1, "tokens": 8, "joint_dim": 64}

    check_figures(ids, state, STEPS)
    if WRITE_SCREENSHOTS:
        screenshot_node(browser_page.page, ids["offload"], DOCS_DIR / "group_offload_readout.png")
        screenshot_node(browser_page.page, ids["report"], DOCS_DIR / "group_offload_report.png")
    finish(browser_page.page, browser_page.console, SCREENSHOT, started)


def test_loader_node_shows_the_readout_too(browser_page: BrowserPage, comfy_server: ComfyServer):
    started = time.monotonic()
    steps = 2
    ids, prompt, state = run_in_page(browser_page, loader_workflow(comfy_server.models.unet_name, steps),
                                      "group_offload_loader")
    assert prompt[ids["offload"]]["class_type"] == "GroupOffloadLoader"
    check_figures(ids, state, steps)
    finish(browser_page.page, browser_page.console, ARTIFACTS / "group_offload_loader.png", started)


def test_messages_by_node_id_and_node_removal(browser_page: BrowserPage, comfy_server: ComfyServer):
    """Messages go to the node of their node_id, and only to an offload node; a removed node lets go."""
    page, console = browser_page.page, browser_page.console
    built = page.evaluate(BUILD_WORKFLOW_JS, asdict(offload_workflow(comfy_server.models.unet_name,
                                                                     comfy_server.models.vae_name, STEPS)))
    ids = built["ids"]
    page.evaluate("""async (workflow) => {
        const { app } = window.comfyAPI.app;
        await app.loadGraphData(workflow);
        app.canvas.ds.scale = 1;
        app.canvas.ds.offset = [70, 120];
    }""", built["workflow"])
    live = {  # mid-run, and the copy-back this pack exists to avoid, for the drawing to show in red
        "node_id": ids["offload"], "final": False, "cpu_only": False, "groups": 40, "resident_groups": 12,
        "streamed_groups": 28, "resident_bytes": 11.4e9, "streamed_bytes_per_pass": 26.6e9, "pinned_bytes": 26.6e9,
        "host_bytes": 38e9, "bytes_h2d": 186e9,
        "bytes_d2h": 1.5e9, "copies_h2d": 196, "onloads": 280, "sync_onloads": 3, "compute_wait_ms": 41.5,
        "hook_us_per_group": 38.0, "steps": 7, "bytes_per_step": 26.6e9, "h2d_gbps": 21.7,
        "step_gbps": [18.2, 21.9, 22.4, 22.1, 21.8, 22.6, 22.3],
    }
    result = page.evaluate("""
        async ({ live, ids }) => {
            const { app } = window.comfyAPI.app;
            const { api } = window.comfyAPI.api;
            const offload = app.graph.getNodeById(ids.offload);
            const sampler = app.graph.getNodeById(ids.sampler);
            api.dispatchCustomEvent("group_offload.telemetry", live);
            api.dispatchCustomEvent("group_offload.telemetry", { ...live, node_id: ids.sampler });
            await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
            return {
                offloadGot: offload.groupOffloadTelemetry?.steps ?? null,
                samplerUntouched: sampler.groupOffloadTelemetry === undefined,
            };
        }
    """, {"live": live, "ids": ids})
    assert result["offloadGot"] == 7 and result["samplerUntouched"]
    screenshot_node(page, ids["offload"], ARTIFACTS / "group_offload_live.png")

    result = page.evaluate("""
        async ({ live, ids, pack_url }) => {
            const { app } = window.comfyAPI.app;
            const { api } = window.comfyAPI.api;
            const common = await import(pack_url + "group_offload_common.js");
            const offload = app.graph.getNodeById(ids.offload);
            app.graph.remove(offload);
            const cleared = offload.groupOffloadTelemetry === null;
            for (const node_id of [ids.offload, "9999", "9999:1", null]) {
                api.dispatchCustomEvent("group_offload.telemetry", { ...live, node_id });
            }
            // Subgraph-qualified ids walk into subgraph nodes.
            const inner = { id: 5 };
            const subgraph = { getNodeById: (i) => (String(i) === "5" ? inner : null) };
            const root = { getNodeById: (i) => (String(i) === "12" ? { subgraph } : null) };
            return {
                cleared,
                stillRemoved: offload.groupOffloadTelemetry === null,
                nested: common.findNodeByExecutionId(root, "12:5") === inner,
                missingParent: common.findNodeByExecutionId(root, "13:5"),
                formats: [0, 512, 512e6, 1.234e9, 12.3e9].map(common.formatBytes)
                    .concat([common.formatRate(12.34), common.formatRate(0.5), common.formatMs(4.5),
                             common.formatUs(40), common.formatUs(6094)]),
            };
        }
    """, {"live": live, "ids": ids, "pack_url": PACK_URL})
    assert result["cleared"] and result["stillRemoved"]
    assert result["nested"] is True and result["missingParent"] is None
    assert result["formats"] == ["0 B", "512 B", "512 MB", "1.23 GB", "12.3 GB", "12.3 GB/s", "500 MB/s", "4.50 ms",
                                 "40.0 µs", "6.09 ms"]
    page.wait_for_timeout(200)
    assert console.take_errors() == [], f"failed requests: {console.failed_requests}"


@pytest.mark.browser
def test_the_report_shows_the_groups_left_in_place(browser_page: BrowserPage, comfy_server: ComfyServer):
    """With nothing packed every group streams from where it lies: the figures of the host budget come with the
    run's, and the report's rows of them appear (with every group packed, ``check_figures`` finds none)."""
    started = time.monotonic()
    workflow = offload_workflow(comfy_server.models.unet_name, comfy_server.models.vae_name, STEPS)
    workflow.nodes["offload"] = ("GroupOffload", [20, 170], {**OFFLOAD_WIDGETS, "host_memory": "budget", "host_gb": 0})
    ids, prompt, state = run_in_page(browser_page, workflow, "group_offload_in_place")
    assert prompt[ids["offload"]]["inputs"]["host_memory"] == "budget"
    check_figures(ids, state, STEPS)
    telemetry, rows = state["telemetry"], state["rows"]
    assert telemetry["packed_bytes"] == 0 and telemetry["in_place_bytes"] == telemetry["host_bytes"] > 0
    assert telemetry["gathered_bytes"] >= STEPS * telemetry["in_place_bytes"] and telemetry["gather_gbps"] > 0
    size = r"\d+(\.\d+)? (B|KB|MB)"
    assert rows["packed_bytes"] == ["Packed host copies", "0 B"]
    assert rows["in_place_bytes"][0] == "Left in place"
    assert re.fullmatch(rf"{size} \(0 B file-backed\)", rows["in_place_bytes"][1])  # ComfyUI's own tensors
    assert rows["host_limit"] == ["Host budget bound by", "host_gb"]
    assert rows["kept_cached_bytes"][0] == "Kept in the page cache"
    assert rows["gathered_bytes_per_step"][0] == "Gathered per step"
    assert re.fullmatch(size, rows["gathered_bytes_per_step"][1])
    assert rows["gather_gbps"][0] == "Gather rate" and re.fullmatch(r"\d+(\.\d+)? (MB|GB)/s", rows["gather_gbps"][1])
    assert rows["read_ahead"] == ["Read ahead", "0 groups"]  # on the CPU nothing is read ahead
    assert rows["gathered_from_disk_bytes"][0] == "Gathered from disk"
    assert re.fullmatch(rf"0 B of {size}", rows["gathered_from_disk_bytes"][1])
    finish(browser_page.page, browser_page.console, ARTIFACTS / "group_offload_in_place.png", started)
