"""ComfyUI's "has moved" / "deprecated" warnings that the pack's own calls make it log (issue 26).

ComfyUI keeps a moved or retired name as an alias that logs a warning through the root logger at
every call (``string_to_seed has moved from comfy.model_patcher to comfy.utils``). A warning counts
as the pack's when the nearest caller outside ComfyUI's checkout (and outside ``logging``) is the
pack's code: ComfyUI's own calls, and the tests' own calls into ComfyUI, do not count.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from testbed.comfy_boot import REPO_ROOT, comfyui_path

DEPRECATION = re.compile(r"has moved|deprecat", re.IGNORECASE)
PACK_CODE = (REPO_ROOT / "nodes", REPO_ROOT / "offload_core")
_LOGGING_DIR = Path(logging.__file__).resolve().parent


def _is_within(path: Path, folders: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def called_by_the_pack(frame: FrameType | None) -> bool:
    """Whether the nearest frame at or above ``frame`` that is neither ComfyUI's nor logging's (nor
    this module's) is the pack's."""
    skipped = (comfyui_path(), _LOGGING_DIR, Path(__file__).resolve())
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()  # the pack's custom_nodes link resolves to REPO_ROOT
        if _is_within(path, PACK_CODE):
            return True
        if not _is_within(path, skipped):
            return False
        frame = frame.f_back
    return False


class PackDeprecations(logging.Handler):
    """Collects the deprecation warnings ComfyUI logs because of the pack, while attached to the root logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        logged_by_comfyui = Path(record.pathname).resolve().is_relative_to(comfyui_path())
        if logged_by_comfyui and DEPRECATION.search(message) and called_by_the_pack(sys._getframe()):
            self.messages.append(message)


@contextlib.contextmanager
def pack_deprecations() -> Iterator[list[str]]:
    """The messages of the deprecation warnings the pack causes inside the ``with`` block."""
    handler = PackDeprecations()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.messages
    finally:
        root.removeHandler(handler)
