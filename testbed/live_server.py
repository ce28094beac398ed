"""A live ComfyUI server on loopback: its real ``main.py`` in a process of its own, serving a base
directory with this pack, the test nodes and the fixture models; API-format prompts for it; and the
Chromium the browser tests point at it.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from testbed.comfy_boot import PACK_DIR_NAME, REPO_ROOT, TESTNODES_DIR, TESTNODES_DIR_NAME, comfyui_path, default_cpu
from testbed.fixture_models import TINY_VAE_NAME, ModelDir, link_or_copy_dir, populate_models

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# API-format workflows
# --------------------------------------------------------------------------------------------

def txt2img_workflow(unet_name: str, vae_name: str = TINY_VAE_NAME, *, seed: int = 0, steps: int = 2,
                     cfg: float = 4.0, width: int = 64, height: int = 64, joint_dim: int = 64,
                     filename_prefix: str = "group_offload_test",
                     model_patch: tuple[str, dict[str, Any]] | None = None) -> dict[str, dict]:
    """An API-format prompt: UNETLoader -> [model_patch] -> KSampler -> VAEDecode -> SaveImage.

    ``model_patch = (class_type, inputs)`` inserts node "10" between loader and sampler; its
    ``model`` input is wired to the loader and its first output to the sampler.
    """
    workflow: dict[str, dict] = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "3": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "joint_dim": joint_dim}},
        "4": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 2, "tokens": 8, "joint_dim": joint_dim}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
            "denoise": 1.0}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["2", 0]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": filename_prefix}},
    }
    if model_patch is not None:
        class_type, inputs = model_patch
        workflow["10"] = {"class_type": class_type, "inputs": {**inputs, "model": ["1", 0]}}
        workflow["6"]["inputs"]["model"] = ["10", 0]
    return workflow


# --------------------------------------------------------------------------------------------
# A real ComfyUI server
# --------------------------------------------------------------------------------------------

class PromptRejected(Exception):
    """POST /prompt answered 400; ``body`` is ComfyUI's error JSON (``error``, ``node_errors``)."""

    def __init__(self, body: dict):
        super().__init__(json.dumps(body)[:2000])
        self.body = body


class PromptFailed(Exception):
    """A queued prompt finished with an execution error; ``entry`` is its /history entry."""

    def __init__(self, entry: dict):
        messages = [m for m in entry.get("status", {}).get("messages", []) if m[0] == "execution_error"]
        super().__init__(json.dumps(messages)[:4000])
        self.entry = entry


@functools.cache
def server_flags(main_py: Path) -> frozenset[str]:
    """The long options this ComfyUI's main.py accepts (from ``main.py --help``)."""
    help_text = subprocess.run([sys.executable, str(main_py), "--help"], capture_output=True, text=True,
                               cwd=main_py.parent, timeout=120, check=True).stdout
    return frozenset(word.strip("[],") for word in help_text.split() if word.startswith("--"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ComfyServer:
    """ComfyUI's real ``main.py`` serving a base directory with this pack, the test nodes and fixtures.

    Use as a context manager; the server is always stopped by its pid on exit. Its output goes to
    ``base_dir/comfyui.log``; :meth:`log_tail` is in every error raised here.
    """

    base_dir: Path
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    # ComfyUI's classic cache drops a node's output as soon as a prompt no longer has the node; newest
    # ComfyUI's default cache keeps it until RAM runs short. Tests of what outlives a model want the first.
    classic_cache: bool = False
    cpu: bool | None = None
    full_width: bool = False
    python: str = sys.executable  # another environment's (one with ComfyUI-Manager) runs ComfyUI's main.py
    link_pack: bool = True  # False: custom_nodes holds the pack only where something else (the Manager) put it
    startup_timeout: float = 120.0
    models: ModelDir = field(init=False)
    object_info: dict = field(init=False, default_factory=dict)
    port: int = field(init=False, default=0)
    process: subprocess.Popen | None = field(init=False, default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "comfyui.log"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    def __enter__(self) -> ComfyServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            logger.error("ComfyUI server log (%s):\n%s", self.log_path, self.log_tail())
        self.stop()

    def _start(self) -> None:
        self.base_dir = Path(self.base_dir).resolve()
        custom_nodes = self.base_dir / "custom_nodes"
        custom_nodes.mkdir(parents=True, exist_ok=True)
        links = [(PACK_DIR_NAME, REPO_ROOT)] if self.link_pack else []
        for name, target in (*links, (TESTNODES_DIR_NAME, TESTNODES_DIR)):
            link_or_copy_dir(target, custom_nodes / name)
        self.models = populate_models(self.base_dir, full_width=self.full_width)

        main_py = comfyui_path() / "main.py"
        flags = server_flags(main_py)
        self.port = _free_port()
        command = [self.python, str(main_py), "--listen", "127.0.0.1", "--port", str(self.port),
                   "--base-directory", str(self.base_dir)]
        if default_cpu() if self.cpu is None else self.cpu:
            command.append("--cpu")
        if "--database-url" in flags:
            # Not sqlite:///:memory:, whose connection SQLAlchemy then uses across threads: ComfyUI
            # logs "SQLite objects created in a thread can only be used in that same thread".
            command += ["--database-url", f"sqlite:///{self.base_dir / 'comfyui.db'}"]
        if self.classic_cache and "--cache-classic" in flags:
            command.append("--cache-classic")
        command += list(self.extra_args)

        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=main_py.parent, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        logger.info("started ComfyUI pid %d: %s", self.process.pid, " ".join(command))
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                self.object_info = self.get("/object_info")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        raise TimeoutError(f"ComfyUI did not answer /object_info within {self.startup_timeout:.0f} s; "
                           f"log:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"ComfyUI server exited (code {code}); log:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminate the server by pid, killing it if it does not exit within 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        logger.info("stopped ComfyUI pid %d", self.process.pid)

    def log_tail(self, max_chars: int = 20000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except FileNotFoundError:
            return "(no log)"

    def _request(self, path: str, body: Any = None, timeout: float = 30.0,
                 content_type: str = "application/json") -> tuple[int, Any]:
        data = None if body is None else body.encode() if content_type == "text/plain" else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        try:
            return status, json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return status, payload.decode(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> Any:
        """GET ``path`` and return the decoded JSON; raises on HTTP errors."""
        status, payload = self._request(path, timeout=timeout)
        if status >= 400:
            raise RuntimeError(f"GET {path} -> HTTP {status}: {payload}")
        return payload

    def post(self, path: str, body: Any, timeout: float = 30.0) -> tuple[int, Any]:
        """POST JSON to ``path``; returns ``(status, decoded body)`` without raising."""
        return self._request(path, body, timeout=timeout)

    def post_text(self, path: str, text: str, timeout: float = 30.0) -> tuple[int, Any]:
        """POST plain text to ``path`` (an endpoint that reads the body as text); as :meth:`post`."""
        return self._request(path, text, timeout=timeout, content_type="text/plain")

    def queue(self, workflow: dict) -> str:
        """Queue an API-format prompt; returns its prompt_id or raises :class:`PromptRejected`."""
        status, payload = self.post("/prompt", {"prompt": workflow})
        if status == 400:
            raise PromptRejected(payload)
        if status != 200:
            raise RuntimeError(f"POST /prompt -> HTTP {status}: {payload}; log:\n{self.log_tail()}")
        return payload["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120.0, check: bool = True) -> dict:
        """Poll /history until the prompt finished; returns its entry.

        With ``check``, a prompt that failed raises :class:`PromptFailed`.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if check and entry["status"].get("status_str") == "error":
                    raise PromptFailed(entry)
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s; log:\n{self.log_tail()}")

    def run(self, workflow: dict, timeout: float = 120.0) -> dict:
        """Queue ``workflow`` and wait for it; returns the /history entry."""
        return self.wait(self.queue(workflow), timeout=timeout)

    def output_images(self, entry: dict) -> list[Path]:
        """The image files a finished prompt saved into the output folder."""
        images = []
        for output in entry.get("outputs", {}).values():
            for image in output.get("images", []):
                if image.get("type") == "output":
                    images.append(self.output_dir / image.get("subfolder", "") / image["filename"])
        return images


def find_chromium() -> str | None:
    """A Chromium/Chrome executable for browser tests (on PATH or installed by Playwright), or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    playwright_dir = Path(os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or Path.home() / ".cache" / "ms-playwright")
    for candidate in sorted(playwright_dir.glob("chromium-*/chrome-linux*/chrome"), reverse=True):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


OFFLOAD = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0}


def with_report(workflow: dict) -> dict:
    model = workflow["6"]["inputs"]["model"]
    workflow["20"] = {"class_type": "GroupOffloadReport", "inputs": {"model": model, "samples": ["6", 0]}}
    return workflow


def pixels(server, entry: dict) -> np.ndarray:
    (path,) = server.output_images(entry)
    return np.asarray(Image.open(path))


def report_of(entry: dict) -> dict:
    return entry["outputs"]["20"]["group_offload"][0]
