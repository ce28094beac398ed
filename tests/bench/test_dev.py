"""dev.py, the entry point CI runs: which ComfyUI versions a command picks, and the counts it reports."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from testbed.comfy_boot import REPO_ROOT


@pytest.fixture(scope="module")
def dev() -> ModuleType:
    """dev.py as a module (not on sys.path: the repository root must stay off it, see comfy_boot)."""
    spec = importlib.util.spec_from_file_location("group_offload_dev", REPO_ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_comfyui_option_is_taken_out_of_the_pytest_arguments(dev: ModuleType):
    assert dev._pop_option(["tests/x.py", "--comfyui", "0.33.0", "-k", "lora"], "--comfyui") == (
        "0.33.0", ["tests/x.py", "-k", "lora"])
    assert dev._pop_option(["--comfyui=0.3.75", "-x"], "--comfyui") == ("0.3.75", ["-x"])
    assert dev._pop_option(["-x"], "--comfyui") == (None, ["-x"])
    with pytest.raises(SystemExit, match="--comfyui needs a value"):
        dev._pop_option(["-x", "--comfyui"], "--comfyui")


def test_versions_picked_with_and_without_the_tarball(dev: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, tmp_path: Path):
    monkeypatch.setattr(dev, "UPSTREAM_TARBALL", tmp_path / "ComfyUI-0.33.0-0f1fa67.tar.gz")
    assert dev._selected(None, "demo") == [dev.EMBEDDED]
    assert dev._selected("0.3.75", "test") == [dev.EMBEDDED]
    with pytest.raises(SystemExit, match="must be one of 0.3.75, 0.33.0"):
        dev._selected("0.34", "test")

    assert dev._selected(None, "test") == [dev.EMBEDDED]
    assert "ComfyUI 0.33.0 not run: its source tarball is missing" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="tarball is missing"):
        dev._selected("0.33.0", "test")

    dev.UPSTREAM_TARBALL.write_bytes(b"")
    assert dev._selected(None, "test") == [dev.EMBEDDED, dev.UPSTREAM]
    assert dev._selected(None, "setup") == [dev.EMBEDDED, dev.UPSTREAM]
    assert dev._selected("0.33.0", "demo") == [dev.UPSTREAM]


def test_counts_come_from_pytests_own_report(dev: ModuleType, tmp_path: Path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='sample')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.xfail(strict=True, reason='sample')\n"
        "def test_expected_failure(): assert False\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('sample')\n"
        "def test_errors(broken): pass\n")
    report = tmp_path / "junit.xml"
    finished = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, text=True)
    assert finished.returncode == 1, finished.stdout
    assert dev._junit_counts(report) == {"passed": 1, "failed": 2, "skipped": 2}
    assert dev._junit_counts(tmp_path / "missing.xml") == {}


def test_comfyui_gguf_is_unpacked_once_and_skipped_without_its_tarball(dev: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture, tmp_path: Path):
    comfyui = tmp_path / "ComfyUI"
    monkeypatch.setattr(dev, "GGUF_NODES_TARBALL", tmp_path / "missing.tar.gz")
    dev._unpack_gguf_nodes(comfyui)
    assert "GGUF tests will be skipped" in capsys.readouterr().out
    assert not (comfyui / "custom_nodes" / "ComfyUI-GGUF").exists()

    source = tmp_path / "source" / "ComfyUI-GGUF"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("NODE_CLASS_MAPPINGS = {}\n")
    with tarfile.open(tmp_path / "ComfyUI-GGUF.tar.gz", "w:gz") as tar:
        tar.add(source, arcname="ComfyUI-GGUF")
    monkeypatch.setattr(dev, "GGUF_NODES_TARBALL", tmp_path / "ComfyUI-GGUF.tar.gz")
    dev._unpack_gguf_nodes(comfyui)
    unpacked = comfyui / "custom_nodes" / "ComfyUI-GGUF" / "__init__.py"
    assert unpacked.read_text() == "NODE_CLASS_MAPPINGS = {}\n"

    unpacked.write_text("# kept\n")  # there already: left as it is
    dev._unpack_gguf_nodes(comfyui)
    assert unpacked.read_text() == "# kept\n"


def test_the_pack_is_linked_under_its_install_name_alone(dev: ModuleType, tmp_path: Path):
    custom_nodes = tmp_path / "ComfyUI" / "custom_nodes"
    custom_nodes.mkdir(parents=True)
    (custom_nodes / "comfyui-group-offload").symlink_to(dev.ROOT)  # this checkout under an older name
    (custom_nodes / "other-pack").symlink_to(tmp_path)
    dev._link_pack(tmp_path / "ComfyUI")
    assert sorted(p.name for p in custom_nodes.iterdir()) == ["group-offload-no-copy-back", "other-pack"]
    assert (custom_nodes / dev.PACK_NAME).resolve() == dev.ROOT
