"""The pack as users get it, by the tools they use, none written here (dev.py setup installs them):

- ComfyUI-Manager, the version ComfyUI's ``manager_requirements.txt`` names (what ``main.py --enable-manager``
  tells users to install), installs the pack from its git URL (a bare clone of this checkout, named as the
  repository in pyproject.toml) through its own HTTP API, then disables and uninstalls it;
- the Comfy Registry's client ``comfy-cli`` validates the pack as ``comfy node publish`` does and packs it;
- ComfyUI's own ``script_examples/websockets_api_example.py`` client queues an offloaded workflow.

Each runs on the committed tree (a clone of HEAD): what a user installs is what is committed.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
from PIL import Image

from testbed.comfy_boot import PACK_DIR_NAME, REPO_ROOT, TESTBED_DIR, comfyui_path, comfyui_version
from testbed.fixture_models import link_or_copy_dir
from testbed.live_server import OFFLOAD, ComfyServer, pixels, report_of, server_flags, txt2img_workflow, with_report

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
REPOSITORY = PYPROJECT["project"]["urls"]["Repository"]
# The Manager names the folder after the git URL's last part; users clone the repository of pyproject.toml.
REPOSITORY_NAME = Path(urlparse(REPOSITORY).path).name
USER_TOOLS = os.environ.get("GROUP_OFFLOAD_USER_TOOLS")
MANAGER_PYTHON = os.environ.get("GROUP_OFFLOAD_MANAGER_PYTHON")
# The narrowest setting that lets the Manager clone a git URL: this flag with ComfyUI listening on loopback;
# security_level stays at its default (normal).
ALLOW_GIT_URL = "[default]\nallow_git_url_install = true\n"


def offloaded_demo_workflow(server: ComfyServer) -> dict:
    """bench/demo.py's graph: UNETLoader -> GroupOffload -> KSampler -> GroupOffloadReport, VAEDecode -> SaveImage."""
    return with_report(txt2img_workflow(server.models.unet_name, model_patch=("GroupOffload", OFFLOAD)))


def user_tool(name: str) -> Path:
    if not USER_TOOLS:
        pytest.skip("GROUP_OFFLOAD_USER_TOOLS is unset: run through `python3 dev.py test`, whose setup installs them")
    return Path(USER_TOOLS) / name


@pytest.fixture(scope="module")
def committed_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clone = tmp_path_factory.mktemp("committed") / REPOSITORY_NAME
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    return clone


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[np.ndarray, dict]]:
    """The demo graph's image and report with the pack loaded by hand (linked into custom_nodes)."""
    with ComfyServer(tmp_path_factory.mktemp("by_hand")) as server:
        entry = server.run(offloaded_demo_workflow(server))
        yield pixels(server, entry), report_of(entry)


# --------------------------------------------------------------------------------------------
# ComfyUI-Manager
# --------------------------------------------------------------------------------------------

def manager_python() -> str:
    if "--enable-manager" not in server_flags(comfyui_path() / "main.py"):
        pytest.skip(f"ComfyUI {comfyui_version()} starts no ComfyUI-Manager (its main.py has no --enable-manager): "
                    "the comfyui-manager package runs only in a ComfyUI that starts it, and the Manager as a "
                    "custom node is cloned from GitHub, which this machine cannot reach")
    if not MANAGER_PYTHON:
        pytest.skip("GROUP_OFFLOAD_MANAGER_PYTHON is unset: run through `python3 dev.py test`, whose setup installs "
                    "the Manager")
    return MANAGER_PYTHON


def manager_server(base_dir: Path) -> ComfyServer:
    """ComfyUI with the Manager's legacy UI, whose HTTP API has "Install via Git URL"; the pack only where the
    Manager put it."""
    return ComfyServer(base_dir, python=manager_python(), link_pack=False, extra_args=["--enable-manager-legacy-ui"])


def manager_task(server: ComfyServer, kind: str, url: str) -> None:
    """Queue ``kind`` (disable, uninstall) of the pack installed from ``url`` and wait until the Manager did it."""
    item = {"id": REPOSITORY_NAME, "version": "unknown", "files": [url], "ui_id": kind}
    status, body = server.post("/v2/manager/queue/batch", {kind: [item]})
    assert status == 200 and body == {"failed": []}, (status, body)
    wait_until(lambda: server.get("/v2/manager/queue/status")["is_processing"] is False, f"the Manager's {kind}")


def wait_until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} did not finish within {timeout:.0f} s"
        time.sleep(0.2)


def test_manager_installs_the_pack_from_its_git_url(tmp_path: Path, committed_tree: Path, by_hand) -> None:
    manager_python()
    # Its URL ends as the repository's does (the Manager finds an unknown pack by that last part); the Manager
    # takes only URLs with a host.
    bare = tmp_path / "git" / REPOSITORY_NAME
    subprocess.run(["git", "clone", "-q", "--bare", str(committed_tree), str(bare)], check=True)
    url = f"file://localhost{bare}"
    base = tmp_path / "base"
    custom_nodes = base / "custom_nodes"

    with manager_server(base) as server:  # the Manager's defaults refuse a git URL
        assert server.post_text("/v2/customnode/install/git_url", url)[0] == 403
    assert not (custom_nodes / REPOSITORY_NAME).exists()

    (base / "user" / "__manager" / "config.ini").write_text(ALLOW_GIT_URL)
    with manager_server(base) as server:
        status, _ = server.post_text("/v2/customnode/install/git_url", url, timeout=120)
        assert status == 200, server.log_tail()
    assert (custom_nodes / PACK_DIR_NAME / ".git").is_dir(), sorted(p.name for p in custom_nodes.iterdir())

    with manager_server(base) as server:
        assert server.object_info["GroupOffload"]["python_module"] == f"custom_nodes.{PACK_DIR_NAME}"
        entry = server.run(offloaded_demo_workflow(server))
        image, report = by_hand
        assert np.array_equal(pixels(server, entry), image)
        assert report_of(entry)["bytes_h2d"] == report["bytes_h2d"] > 0
        manager_task(server, "disable", url)

    assert (custom_nodes / ".disabled" / PACK_DIR_NAME).is_dir() and not (custom_nodes / PACK_DIR_NAME).exists()
    with manager_server(base) as server:
        assert "GroupOffload" not in server.object_info and "KSampler" in server.object_info
        manager_task(server, "uninstall", url)

    with manager_server(base) as server:
        assert "GroupOffload" not in server.object_info and "KSampler" in server.object_info
    assert not (custom_nodes / ".disabled" / PACK_DIR_NAME).exists(), "the uninstall left the pack's folder"


# --------------------------------------------------------------------------------------------
# Installs the pack cannot use: one message at start-up, and ComfyUI starts
# --------------------------------------------------------------------------------------------

def started_beside(tmp_path: Path, name: str, folder: Path) -> tuple[dict, str]:
    """/object_info and the log of ComfyUI started with the pack and ``folder`` as custom_nodes/``name``."""
    link_or_copy_dir(folder, tmp_path / "custom_nodes" / name)
    with ComfyServer(tmp_path) as server:
        return server.object_info, server.log_tail(max_chars=10**7)


def test_a_comfyui_older_than_the_pack_supports_gets_one_message(tmp_path: Path) -> None:
    object_info, log = started_beside(tmp_path, "older_comfyui", TESTBED_DIR / "older_comfyui")
    assert "GroupOffload" not in object_info and "KSampler" in object_info
    assert ("Group Offload (no copy-back) needs ComfyUI 0.3.75 or newer; this ComfyUI "
            f"({comfyui_version()}) lacks comfy.weight_adapter.WeightAdapterBase") in log, log
    assert f"Cannot import {tmp_path / 'custom_nodes'}" not in log, log  # ComfyUI's line for a pack that raised


def test_a_second_copy_of_the_pack_gets_one_message_and_the_first_keeps_its_nodes(tmp_path: Path) -> None:
    object_info, log = started_beside(tmp_path, "ComfyUI-GroupOffload", REPO_ROOT)
    assert object_info["GroupOffload"]["python_module"] in {f"custom_nodes.{name}" for name in
                                                            (PACK_DIR_NAME, "ComfyUI-GroupOffload")}
    assert log.count("Group Offload (no copy-back) is installed twice") == 1, log
    assert f"Cannot import {tmp_path / 'custom_nodes'}" not in log, log  # ComfyUI's line for a pack that raised


# --------------------------------------------------------------------------------------------
# The Comfy Registry's client
# --------------------------------------------------------------------------------------------

# What a user of the Registry's archive needs, and what only development does.
PACKED = {"__init__.py", "nodes", "offload_core", "web", "locales", "example_workflows", "README.md", "LICENSE",
          "pyproject.toml", "icon.png"}
NOT_PACKED = {"testbed", "tests", "bench", "dev.py", ".ci"}


def comfy(committed_tree: Path, *args: str) -> str:
    """``comfy --skip-prompt ARGS`` in the committed tree; its output (it exits 0 or the test fails)."""
    result = subprocess.run([str(user_tool("comfy")), "--skip-prompt", *args], cwd=committed_tree,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
                            env=dict(os.environ, HOME=str(committed_tree.parent / "home")))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_comfy_node_validate_passes_with_no_warning(committed_tree: Path) -> None:
    output = comfy(committed_tree, "node", "validate")
    assert "All validation checks passed successfully" in output, output
    assert "Warning" not in output and "Error" not in output, output


def test_comfy_node_pack_holds_what_users_need_and_no_test_bed(committed_tree: Path) -> None:
    comfy(committed_tree, "node", "pack")
    with zipfile.ZipFile(committed_tree / "node.zip") as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert PACKED <= tops, f"missing from the archive: {PACKED - tops}"
    assert not NOT_PACKED & tops, f"in the archive: {NOT_PACKED & tops}"


def test_registry_fields_are_complete() -> None:
    comfy_fields = PYPROJECT["tool"]["comfy"]
    assert PYPROJECT["project"]["name"] == PACK_DIR_NAME == REPOSITORY_NAME
    assert PYPROJECT["project"]["license"] == {"file": "LICENSE"} and (REPO_ROOT / "LICENSE").is_file()
    assert comfy_fields["PublisherId"] and comfy_fields["DisplayName"] and comfy_fields["requires-comfyui"]
    # The Icon is this repository's own icon.png on its main branch, a small square PNG.
    icon_url = urlparse(comfy_fields["Icon"])
    owner_and_name = urlparse(REPOSITORY).path.strip("/")
    assert icon_url.hostname == "raw.githubusercontent.com" and icon_url.path.startswith(f"/{owner_and_name}/main/")
    with Image.open(REPO_ROOT / icon_url.path.removeprefix(f"/{owner_and_name}/main/")) as icon:
        assert icon.format == "PNG" and icon.width == icon.height <= 400


# --------------------------------------------------------------------------------------------
# A headless client: ComfyUI's own websocket example
# --------------------------------------------------------------------------------------------

def test_comfyuis_websocket_example_runs_an_offloaded_workflow(tmp_path: Path, by_hand) -> None:
    client = [str(user_tool("python")), str(TESTBED_DIR / "script_example_client.py"), str(comfyui_path())]
    with ComfyServer(tmp_path) as server:
        workflow = offloaded_demo_workflow(server)
        result = subprocess.run([*client, f"127.0.0.1:{server.port}"], input=json.dumps(workflow),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr + server.log_tail()
        downloaded = json.loads(result.stdout)
        (entry,) = server.get("/history").values()
    assert len(downloaded["8"]) == 1  # SaveImage's one image, fetched by the example through /view
    assert np.array_equal(pixels(server, entry), by_hand[0])
    stats = report_of(entry)
    assert stats["streamed_groups"] == stats["groups"] > 0 and stats["bytes_d2h"] == 0

