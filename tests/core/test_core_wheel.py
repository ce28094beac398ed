"""``pip install .`` as the README gives it: a wheel of the pure-torch core alone, which then offloads a
diffusers-style model with nothing of this checkout on the path.

The checkout is copied first (setuptools writes its build folders into the source tree), then installed
offline with pip into a target folder, without dependencies or build isolation: this environment's torch
and setuptools are used, nothing is downloaded.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from testbed.comfy_boot import REPO_ROOT

# A transformer laid out as diffusers lays one out (``transformer_blocks``, blocks called with keyword
# arguments, returning both streams), offloaded as the README says; run with only the wheel on the path.
DIFFUSERS_STYLE_RUN = """
import json, sys
import torch
from torch import nn
import offload_core

class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.context_proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states) + temb[:, None])
        hidden_states = hidden_states + self.ff(hidden_states)
        return encoder_hidden_states + self.context_proj(encoder_hidden_states), hidden_states

class Transformer2DModel(nn.Module):
    def __init__(self, dim=32, layers=4):
        super().__init__()
        self.time_embed = nn.Linear(1, dim)
        self.transformer_blocks = nn.ModuleList(TransformerBlock(dim) for _ in range(layers))
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        temb = self.time_embed(timestep[:, None])
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                         encoder_hidden_states=encoder_hidden_states, temb=temb)
        return self.proj_out(hidden_states)

torch.manual_seed(0)
model = Transformer2DModel().eval()
inputs = (torch.randn(2, 16, 32), torch.randn(2, 7, 32), torch.tensor([0.25, 0.75]))
with torch.no_grad():
    expected = model(*inputs)
    handle = offload_core.apply_group_offload(model, model.transformer_blocks, "cpu", prefetch=1)
    offloaded = model(*inputs)
    stats = handle.stats()
    handle.remove()
    removed = model(*inputs)
json.dump({"core": offload_core.__file__, "equal": torch.equal(offloaded, expected),
           "equal_after_remove": torch.equal(removed, expected), "groups": stats["groups"],
           "copies_h2d": stats["copies_h2d"], "bytes_d2h": stats["bytes_d2h"]}, sys.stdout)
"""


def _source_tree(destination: Path) -> Path:
    """The checkout's own files (no virtual environments, ComfyUI trees or caches), as ``pip install .`` sees them."""
    return Path(shutil.copytree(REPO_ROOT, destination, ignore=shutil.ignore_patterns(".*", "__pycache__")))


def _run(command: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    finished = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, **kwargs)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished


def test_pip_install_builds_the_core_alone_and_it_offloads_a_diffusers_style_model(tmp_path: Path):
    source, site = _source_tree(tmp_path / "checkout"), tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps",
          "--no-build-isolation", "--target", str(site), "."], cwd=source)

    installed = sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info"))
    assert installed == ["offload_core"]  # never a top-level `nodes`, which would shadow ComfyUI's nodes.py
    (metadata,) = site.glob("group_offload_no_copy_back-*.dist-info/METADATA")
    assert "Requires-Python: >=3.11" in metadata.read_text().splitlines()

    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    finished = _run([sys.executable, "-P", "-c", DIFFUSERS_STYLE_RUN], cwd=tmp_path, env=environment)
    result = json.loads(finished.stdout)
    assert Path(result["core"]).parent == site / "offload_core"
    assert result == {**result, "equal": True, "equal_after_remove": True, "groups": 4, "bytes_d2h": 0}
    assert result["copies_h2d"] > 0
