"""The benchmarks' tests import bench/'s scripts as modules (``cost_model``, ``soak``, ``host_budget_box``,
``gpu.config``), as the scripts import each other: bench/ goes on ``sys.path`` here, once."""
import sys

from testbed.comfy_boot import REPO_ROOT

BENCH_DIR = REPO_ROOT / "bench"

if str(BENCH_DIR) not in sys.path:
    sys.path.append(str(BENCH_DIR))
