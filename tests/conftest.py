"""Fixtures on real ComfyUI: an in-process ComfyUI (comfy_boot), fixture models (fixture_models) and a
live server (live_server)."""
from __future__ import annotations

import gc
import os

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from testbed import gguf_files
from testbed import gpu_decisions
from testbed.comfy_boot import REPO_ROOT, boot_comfyui_in_process, comfyui_path, comfyui_version
from testbed.deprecations import pack_deprecations
from testbed.fake_cudart import FakeCudart, install as install_fake_cudart
from testbed.fixture_models import (
    FULL_WIDTH_QWEN_NAME,
    ModelDir,
    full_width_qwen_image_file,
    populate_models,
    tiny_qwen_image_file,
    tiny_wan_vae_file,
    use_models_in_process,
)
from testbed.live_server import ComfyServer, find_chromium
from testbed.stream_checker import StreamChecker


# Fixtures the test bed defines beside its helpers: models, device (node_runs); gguf_models (gguf_runs);
# quantized_models (quantized_files).
pytest_plugins = ["testbed.node_runs", "testbed.gguf_runs", "testbed.quantized_files"]


class _RepositoryIsNotATestPackage:
    """Collect the repository root as a plain directory, not as a package.

    ``python3 dev.py test`` roots pytest at tests/ (``-c tests/pytest.ini``); this covers a bare
    ``pytest`` in the repository root. The root ``__init__.py`` is the pack's entry point for
    ComfyUI: as a pytest Package it would be imported under the checkout folder's name before
    ComfyUI is on sys.path. The hook must be global: for the root, pytest asks only plugins and
    conftests above it.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        if path.resolve() == REPO_ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_RepositoryIsNotATestPackage(), "group-offload-repository-root")


def pytest_report_header(config: pytest.Config) -> str:
    return f"ComfyUI {comfyui_version()} at {comfyui_path()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    no_chromium = pytest.mark.skip(reason="needs Chromium (apt-get install chromium)")
    cuda = torch.cuda.is_available()
    chromium = any("browser" in item.keywords for item in items) and find_chromium() is not None
    for item in items:
        if "cuda" in item.keywords and not cuda:
            item.add_marker(no_cuda)
        if "browser" in item.keywords and not chromium:
            item.add_marker(no_chromium)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Attach the server's log to the report of a failed test that used the server."""
    report = yield
    server = getattr(item, "funcargs", {}).get("comfy_server")
    if report.failed and isinstance(server, ComfyServer):
        report.sections.append(("ComfyUI server log (tail)", server.log_tail(8000)))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Fail a test during which the pack made ComfyUI log a "has moved" / "deprecated" warning: any
    deprecation ComfyUI raises because of the pack is a defect (issue 26). In-process ComfyUI only."""
    with pack_deprecations() as messages:
        result = yield
    if messages:
        pytest.fail(f"ComfyUI logged {len(messages)} deprecation warning(s) because of the pack, "
                    f"the first: {messages[0]!r}", pytrace=False)
    return result


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's ``nodes`` module, booted in this process (``--cpu`` without CUDA)."""
    return boot_comfyui_in_process()


@pytest.fixture(autouse=True)
def decisions_of_the_card(monkeypatch: pytest.MonkeyPatch) -> gpu_decisions.Card | None:
    """With ``GROUP_OFFLOAD_CARD`` set (a name in ``gpu_decisions.CARDS``), in-process ComfyUI takes the
    decisions it takes on that card in every test (the tests then compare with ComfyUI deciding the same)."""
    name = os.environ.get(gpu_decisions.CARD_VARIABLE)
    if not name:
        return None
    if name not in gpu_decisions.CARDS:
        raise pytest.UsageError(f"{gpu_decisions.CARD_VARIABLE}={name}: not one of {', '.join(gpu_decisions.CARDS)}")
    boot_comfyui_in_process()
    card = gpu_decisions.CARDS[name]
    gpu_decisions.install(card, monkeypatch.setattr)
    return card


@pytest.fixture
def aimdo_switch(comfy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamic VRAM's global switch on, as main.py sets it when comfy-aimdo starts (Linear and Embedding weights
    then load lazily, in the file's dtype)."""
    memory_management = pytest.importorskip("comfy.memory_management", reason="this ComfyUI has no Dynamic VRAM")
    monkeypatch.setattr(memory_management, "aimdo_enabled", True)


@pytest.fixture
def fake_cudart(comfy, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    """ComfyUI pins through a recording stand-in for the CUDA runtime, as on a GPU machine (see fake_cudart)."""
    import comfy.model_management as mm

    yield install_fake_cudart(monkeypatch.setattr)
    mm.unload_all_models()
    gc.collect()  # what the test left behind unpins now, through the stand-in that pinned it


@pytest.fixture
def stream_checker(monkeypatch: pytest.MonkeyPatch) -> Iterator[StreamChecker]:
    """The happens-before checker standing in for the CUDA runtime (see stream_checker); the default
    pinner registers host memory with it too."""
    active = StreamChecker()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: active.cudart)
    with active:
        yield active
        gc.collect()  # mirrors the test left behind unpin now, through the stand-in that pinned them


@pytest.fixture
def checker(stream_checker: StreamChecker) -> Iterator[StreamChecker]:
    """The stream checker, and no race found in the whole test (a race in a finalizer is kept, not raised)."""
    yield stream_checker
    assert stream_checker.races == []


@pytest.fixture(scope="session")
def tiny_qwen_path() -> Path:
    return tiny_qwen_image_file()


@pytest.fixture(scope="session")
def tiny_vae_path() -> Path:
    return tiny_wan_vae_file()


@pytest.fixture(scope="session")
def comfy_models(comfy, tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    """Fixture models the in-process loader nodes find by ``unet_name`` / ``vae_name``."""
    models = populate_models(tmp_path_factory.mktemp("comfy_models"))
    use_models_in_process(models)
    return models


@pytest.fixture(scope="session")
def _full_width_qwen_file() -> Path:
    return full_width_qwen_image_file()


@pytest.fixture
def full_width_qwen_path(request: pytest.FixtureRequest, _full_width_qwen_file: Path) -> Path:
    """The 761 MB real-width single-block Qwen-Image; only for tests marked ``slow``."""
    if request.node.get_closest_marker("slow") is None:
        pytest.fail("full_width_qwen_path is only for tests marked @pytest.mark.slow")
    return _full_width_qwen_file


@pytest.fixture
def full_width_qwen_name(comfy_models: ModelDir, full_width_qwen_path: Path) -> str:
    """``unet_name`` of the full-width model for the in-process UNETLoader (slow tests only)."""
    target = comfy_models.models_dir / "diffusion_models" / FULL_WIDTH_QWEN_NAME
    if not target.exists():
        target.symlink_to(full_width_qwen_path)
    return FULL_WIDTH_QWEN_NAME


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A real ComfyUI server (main.py) with this pack, the test nodes, ComfyUI-GGUF where dev.py unpacked it, and
    the tiny models; it pins through the CUDA-runtime stand-in (``fake_cudart``), as ComfyUI pins on a GPU
    machine, and drops a node's output as soon as a prompt no longer has the node (the classic cache)."""
    fake_cudart = {"GROUP_OFFLOAD_FAKE_CUDART": "1"}  # read by the test nodes inside the server
    base_dir = tmp_path_factory.mktemp("comfy_server")
    if gguf_files.comfyui_gguf_missing() is None:
        gguf_files.link_comfyui_gguf(base_dir)  # for the GGUF template in the browser
    with ComfyServer(base_dir, env=fake_cudart, classic_cache=True) as server:
        yield server
