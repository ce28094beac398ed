"""Markdown tables and the sections of BENCHMARKS.md that the benchmark scripts rewrite."""
from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_section(heading: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the ``## heading`` section of ``path`` (up to the next ``## ``) with ``body``.

    The section is appended when missing; the rest of the file is left as it is.
    """
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## {heading}\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def section_arguments(doc: str, smoke: str) -> argparse.ArgumentParser:
    """The options of a benchmark that writes its section of BENCHMARKS.md: ``--versions``, ``--dry-run`` and
    ``--smoke`` (``smoke``: what that runs)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--versions", help="ComfyUI versions of dev.py, comma-separated (default: the one in use)")
    parser.add_argument("--dry-run", action="store_true", help="print the section, leave BENCHMARKS.md as it is")
    parser.add_argument("--smoke", action="store_true", help=f"{smoke}; implies --dry-run")
    return parser


def publish(heading: str, markdown: str, write: bool) -> None:
    """Print a benchmark's section, and put it in BENCHMARKS.md under ``## heading`` where ``write``."""
    print(markdown)
    if write:
        replace_section(heading, markdown)


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell; ``—`` for a figure that does not apply."""
    return "—" if value is None else f"{value:.{digits}f}"
