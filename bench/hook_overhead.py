"""Hook overhead per group, measured cleanly on a plain torch model shaped like Qwen-Image.

Each block has exactly the tensors of ComfyUI's ``QwenImageTransformerBlock`` (32 tensors in 38
modules: modulation, attention with its four RMSNorms, two MLPs), at the real width or narrowed by
``narrow`` in every dimension.  The blocks compute nothing (``forward`` returns its input), so
what is timed is the offload machinery alone.

On the CPU the "device" is the host, so the ledger's hook time includes the host-to-host copy of
the group.  Reported per configuration:

- ``hook µs/group``     the ledger's ``hook_seconds / hook_calls`` per forward, median (and p90) over
                        the forwards after the first;
- ``copy µs``           one ``slab.copy_(mirror)`` of the group's bytes, timed on its own (median);
- ``hook − copy``       what the hooks cost beyond moving the bytes;
- ``re-point µs``       pointing every tensor of a group at the device views and back again (the
                        engine's ``ModuleGroup.bind``), timed on its own: the irreducible cost of a
                        no-copy-back offload;
- ``wall µs/group``     (forward time with the engine − without) / groups: everything, including
                        PyTorch's dispatch of the module hooks, which the ledger cannot see.

It runs with one intra-op thread by default (``--threads``): with two, every small parallel
``copy_`` after a pause waits for OpenMP to wake its second thread, ≈2.5 ms median on the 2-vCPU
machine of the first measurement, an artefact a CUDA copy never pays.

Run ``python bench/hook_overhead.py [--profile] [--threads N]``; ``cpu_benchmark.py`` runs it too.

Before and after a change, in the same run: ``--base DIR`` loads the ``offload_core`` of another checkout
(``git worktree add DIR REV``, or ``git archive REV | tar -x -C DIR``) beside this one and measures the
narrow configurations on both, alternated for ``--rounds`` rounds (the order swapped each round), so that
both see the same machine load; it prints each one's per-group hook time, the median of the rounds and the
fastest round (under a heavy load a round that was descheduled reads several times slower), and their ratios.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
from types import ModuleType
from pathlib import Path
import logging
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bench_paths import REPO_ROOT  # first: it puts the repository root (offload_core) on sys.path
import offload_core
from reporting import fmt, markdown_table

log = logging.getLogger("hook_overhead")

QWEN_WIDTH, QWEN_HEAD_DIM, QWEN_FFN_MULT, QWEN_MOD_MULT = 3072, 128, 4, 6
TARGET_US = 50.0


class _Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype), requires_grad=False)


class _Norm(nn.Module):
    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)


class QwenLikeBlock(nn.Module):
    """The tensor layout of a Qwen-Image block, ``1/narrow`` of its width; computes nothing."""

    def __init__(self, narrow: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        d, head, ffn = QWEN_WIDTH // narrow, max(1, QWEN_HEAD_DIM // narrow), QWEN_FFN_MULT * QWEN_WIDTH // narrow
        self.img_mod = nn.Sequential(nn.SiLU(), _Linear(d, QWEN_MOD_MULT * d, dtype))
        self.txt_mod = nn.Sequential(nn.SiLU(), _Linear(d, QWEN_MOD_MULT * d, dtype))
        self.img_mlp = nn.Sequential(_Linear(d, ffn, dtype), nn.GELU(), _Linear(ffn, d, dtype))
        self.txt_mlp = nn.Sequential(_Linear(d, ffn, dtype), nn.GELU(), _Linear(ffn, d, dtype))
        self.attn = nn.Module()
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            self.attn.add_module(name, _Norm(head, dtype))
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            self.attn.add_module(name, _Linear(d, d, dtype))
        self.attn.to_out = nn.ModuleList([_Linear(d, d, dtype), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class QwenLikeModel(nn.Module):
    def __init__(self, blocks: int, narrow: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(QwenLikeBlock(narrow, dtype) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class Config:
    label: str
    blocks: int
    narrow: int
    prefetch: int
    resident_fraction: float  # of the groups; 0 = stream every group
    forwards: int
    quantized: bool = False  # Linear weights as comfy-kitchen fp8 QuantizedTensors (a wrapper subclass)


def default_configs(quick: bool = False) -> list[Config]:
    n = 30 if quick else 200
    return [
        Config("Qwen-like, 1/128 width, stream_all, prefetch 0", 60, 128, 0, 0.0, n),
        Config("Qwen-like, 1/128 width, stream_all, prefetch 1", 60, 128, 1, 0.0, n),
        Config("Qwen-like, 1/128 width, half resident, prefetch 1", 60, 128, 1, 0.5, n),
        Config("Qwen-like, 1/128 width, fp8 QuantizedTensor weights, stream_all, prefetch 1", 60, 128, 1, 0.0, n,
               quantized=True),
        Config("Qwen-like, full width (680 MB/group), stream_all, prefetch 1", 2, 1, 1, 0.0, 2 if quick else 4),
    ]


def quantize_linears(model: nn.Module, layout: str = "TensorCoreFP8Layout", **options: object) -> None:
    """Each Linear weight a comfy-kitchen ``QuantizedTensor`` Parameter of ``layout`` (random values),
    made under inference mode, as newest ComfyUI loads a ``comfy_quant`` checkpoint."""
    from comfy_kitchen.tensor.base import QuantizedTensor

    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, _Linear):
                weight = QuantizedTensor.from_float(torch.randn(module.weight.shape), layout, **options)
                module.weight = nn.Parameter(weight, requires_grad=False)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def _forward_times(model: nn.Module, x: torch.Tensor, forwards: int) -> list[float]:
    times = []
    for _ in range(forwards):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return times


def measure(config: Config, profiler: cProfile.Profile | None = None,
            core: ModuleType = offload_core) -> dict[str, float | str | int]:
    """One configuration: engine on, ``config.forwards`` forwards, the figures of the module docstring.

    With ``profiler``, the forwards after the first run under it (which inflates the figures); ``core``: the
    ``offload_core`` package to measure (another checkout's, for ``compare``).
    """
    torch.manual_seed(0)
    model = QwenLikeModel(config.blocks, config.narrow)
    if config.quantized:
        quantize_linears(model)
    x = torch.zeros(1)
    plain = statistics.median(_forward_times(model, x, max(3, config.forwards // 4)))
    handle = core.apply_group_offload(model, list(model.transformer_blocks), "cpu", prefetch=config.prefetch)
    group = handle.groups[0]
    resident = int(round(config.resident_fraction * len(handle.groups)))
    handle.set_resident_bytes(sum(sorted(g.nbytes for g in handle.groups)[:resident]))

    per_group_us, walls = [], []
    for i in range(config.forwards):
        before = (handle.ledger.hook_seconds, handle.ledger.hook_calls)
        if profiler is not None and i > 0:
            profiler.enable()
        start = time.perf_counter()
        model(x)
        walls.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.disable()
        calls = handle.ledger.hook_calls - before[1]
        if i > 0 and calls:
            per_group_us.append(1e6 * (handle.ledger.hook_seconds - before[0]) / calls)

    stats = handle.stats()
    slab = torch.empty(group.nbytes, dtype=torch.uint8)
    repeats = 200 if group.nbytes < 2**24 else 3
    copy_us = _median_us(lambda: slab.copy_(group.mirror.buffer), repeats)
    device_views = group.device_views(slab)
    host = core.group.HOST
    repoint_us = _median_us(lambda: (group.bind(slab.data_ptr(), device_views), group.bind(host, group.mirror.views)),
                            200)
    handle.remove()

    hook_us = statistics.median(per_group_us)
    return {
        "config": config.label,
        "groups": stats["groups"],
        "resident_groups": stats["resident_groups"],
        "tensors_per_group": len(group.bindings),
        "group_bytes": group.nbytes,
        "forwards": len(per_group_us),
        "hook_us": hook_us,
        "hook_us_p90": statistics.quantiles(per_group_us, n=10)[-1] if len(per_group_us) > 1 else hook_us,
        "copy_us": copy_us,
        "hook_minus_copy_us": hook_us - copy_us,
        "repoint_us": repoint_us,
        "wall_us_per_group": 1e6 * (statistics.median(walls[1:]) - plain) / config.blocks,
    }


def run_all(quick: bool = False, profile: bool = False, threads: int = 1) -> tuple[list[dict], str | None]:
    """Every default configuration; with ``profile``, also a cProfile of a separate narrow streamed run."""
    torch.set_num_threads(threads)
    configs = [c for c in default_configs(quick) if not c.quantized or importlib.util.find_spec("comfy_kitchen")]
    results = []
    for config in configs:
        results.append(measure(config))
        log.info("%s: %.1f µs/group", config.label, results[-1]["hook_us"])
    if not profile:
        return results, None
    profiler = cProfile.Profile()
    measure(next(c for c in configs if c.narrow > 1 and c.prefetch > 0 and c.resident_fraction == 0.0), profiler)
    return results, _profile_text(pstats.Stats(profiler))


def _load_other_core(checkout: Path) -> ModuleType:
    """``checkout``'s ``offload_core``, imported beside this one as ``offload_core_base``."""
    folder = checkout / "offload_core"
    if not (folder / "__init__.py").is_file():
        raise SystemExit(f"--base {checkout}: no offload_core/ there; give a checkout of the base commit")
    spec = importlib.util.spec_from_file_location("offload_core_base", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    core = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = core  # its relative imports resolve under that name
    spec.loader.exec_module(core)
    return core


def compare(checkout: Path, rounds: int, quick: bool = False, threads: int = 1) -> list[dict]:
    """Per-group hook time of ``checkout``'s core and this one's, alternated in this process, narrow configurations."""
    torch.set_num_threads(threads)
    cores = {"base": _load_other_core(checkout), "this": offload_core}
    configs = [c for c in default_configs(quick)
               if c.narrow > 1 and (not c.quantized or importlib.util.find_spec("comfy_kitchen"))]
    hook_us: dict[tuple[str, str], list[float]] = {(name, c.label): [] for name in cores for c in configs}
    for turn in range(rounds):
        for name in (["base", "this"] if turn % 2 == 0 else ["this", "base"]):
            for config in configs:
                hook_us[(name, config.label)].append(measure(config, core=cores[name])["hook_us"])
        log.info("round %d of %d done", turn + 1, rounds)
    return [{"config": c.label, **{f"{name}_{figure}": reduce(hook_us[(name, c.label)])
                                   for name in cores for figure, reduce in (("us", statistics.median), ("min_us", min))}}
            for c in configs]


def comparison_table(rows: list[dict]) -> str:
    headers = ["configuration", "base hook µs/group", "this hook µs/group", "this ÷ base", "fastest round: base",
               "this", "this ÷ base"]
    return markdown_table(headers, [[r["config"], fmt(r["base_us"], 1), fmt(r["this_us"], 1),
                                     fmt(r["this_us"] / r["base_us"], 3), fmt(r["base_min_us"], 1),
                                     fmt(r["this_min_us"], 1), fmt(r["this_min_us"] / r["base_min_us"], 3)]
                                    for r in rows])


def _profile_text(stats: pstats.Stats, top: int = 14) -> str:
    """The ``top`` functions by own time, with paths shortened to the repository or site-packages."""
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    prefixes = [str(REPO_ROOT) + "/", torch.__file__.rsplit("torch/", 1)[0]]
    text = "\n".join(line for line in lines[start:] if line.strip())
    for prefix in prefixes:
        text = text.replace(prefix, "")
    return text


def results_table(results: list[dict]) -> str:
    headers = ["configuration", "groups (resident)", "tensors/group", "KB/group", "hook µs/group (p90)",
               "copy µs", "hook − copy µs", "re-point µs", "wall µs/group"]
    rows = [[r["config"], f"{r['groups']} ({r['resident_groups']})", r["tensors_per_group"],
             f"{r['group_bytes'] / 1024:,.0f}", f"{fmt(r['hook_us'], 1)} ({fmt(r['hook_us_p90'], 1)})",
             fmt(r["copy_us"], 1), fmt(r["hook_minus_copy_us"], 1), fmt(r["repoint_us"], 1),
             fmt(r["wall_us_per_group"], 1)] for r in results]
    return markdown_table(headers, rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer forwards")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of a narrow streamed run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see above)")
    parser.add_argument("--base", type=Path, help="a checkout of the base commit: compare its core with this one")
    parser.add_argument("--rounds", type=int, default=10, help="with --base: alternations (default 10)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.base is not None:
        print(comparison_table(compare(args.base, args.rounds, args.quick, args.threads)))
        return 0
    results, profile = run_all(args.quick, args.profile, args.threads)
    print(results_table(results))
    if profile:
        print("\n" + profile)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
