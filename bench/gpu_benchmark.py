"""GPU benchmark: full-size Qwen-Image through ComfyUI's sampler, this pack against ComfyUI as shipped.

The command (the code is the ``bench/gpu/`` package; its docstring says what each family and row measures)::

    .venv/bin/python bench/gpu_benchmark.py            # results in $OUT, else .artifacts/gpu
    .venv/bin/python bench/gpu_benchmark.py --smoke    # every family and row, tiny, on the CPU
"""
from __future__ import annotations

import sys

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
from gpu.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
