"""Soak: random API runs against one real ComfyUI server, driven the way a heavy user drives it.

Each run picks at random: the offloaded model from the Group Offload node or from its loader; the
node's options; a LoRA after it, at one of a few strengths, or none; the node bypassed (what the
frontend sends for mode 4: the workflow without the node, its input wired through); an interrupt
while it runs; a ``POST /free`` after it. Every latent that comes out is compared, bit for bit,
with the plain workflow's for the same seed and LoRA strength. At the end, after a last ``/free``:
the handles and host mirrors still alive (should be none) and the RSS against its level after the
first load.

    python3 bench/soak.py --runs 200      # writes the "Soak" section of BENCHMARKS.md

``tests/bench/test_soak.py`` runs a short soak through :func:`soak` in the suite.
"""
from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

import bench_paths  # noqa: F401  (puts the repository root on sys.path: offload_core, testbed)
from testbed.live_server import ComfyServer
from testbed.lora_fixture import make_lora
from reporting import markdown_table, replace_section

log = logging.getLogger("soak")

LORA = "soak_lora.safetensors"
SEEDS = (1, 2)
LORA_STRENGTHS = (None, 0.4, 0.9)
LIVE = "99"


@dataclass(frozen=True)
class Run:
    """One random API run."""

    source: str  # "node" (UNETLoader -> Group Offload), "loader" (its loader) or "plain"
    seed: int
    lora: float | None
    options: dict
    steps: int = 2
    bypass: bool = False
    interrupt: bool = False
    free_after: bool = False

    @classmethod
    def draw(cls, rng: random.Random) -> Run:
        residency = rng.choice(["stream_all", "budget", "auto"])
        options = {"blocks_per_group": rng.choice([1, 2]), "prefetch": rng.choice([0, 1, 2]), "residency": residency,
                   "resident_gb": rng.choice([0.0, 0.0002, 1.0]) if residency == "budget" else 0.0}
        source, interrupt = rng.choice(["node", "loader"]), rng.random() < 0.1
        return cls(source, rng.choice(SEEDS), rng.choice(LORA_STRENGTHS), options,
                   steps=400 if interrupt else 2,  # long enough for the interrupt to land mid-run
                   bypass=source == "node" and rng.random() < 0.15, interrupt=interrupt, free_after=rng.random() < 0.1)



@dataclass
class SoakResult:
    runs: int = 0
    compared: int = 0
    wrong_latents: list[str] = field(default_factory=list)
    interrupted: int = 0
    frees: int = 0
    seconds: float = 0.0
    rss_first_load: int = 0
    rss_after_free: int = 0
    live_after_free: dict = field(default_factory=dict)

    @property
    def rss_drift(self) -> float:
        return self.rss_after_free / self.rss_first_load - 1


def workflow(unet_name: str, run: Run, prefix: str, count_live: bool = False) -> dict:
    """Loader -> [Group Offload] -> [LoRA] -> KSampler -> SaveLatent [-> the live-object counter]."""
    loader = "GroupOffloadLoader" if run.source == "loader" else "UNETLoader"
    options = run.options if run.source == "loader" else {}
    prompt = {
        "1": {"class_type": loader, "inputs": {"unet_name": unet_name, "weight_dtype": "default", **options}},
        "3": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "joint_dim": 64}},
        "4": {"class_type": "GroupOffloadTestConditioning", "inputs": {"seed": 2, "tokens": 8, "joint_dim": 64}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "seed": run.seed, "steps": run.steps, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": prefix}},
    }
    if count_live:  # a full garbage collection: about as long as the run itself
        prompt[LIVE] = {"class_type": "GroupOffloadTestLiveObjects", "inputs": {"samples": ["6", 0]}}
    model = ["1", 0]
    if run.source == "node" and not run.bypass:
        prompt["10"] = {"class_type": "GroupOffload", "inputs": {"model": model, **run.options}}
        model = ["10", 0]
    if run.lora is not None:
        prompt["11"] = {"class_type": "LoraLoaderModelOnly",
                        "inputs": {"model": model, "lora_name": LORA, "strength_model": run.lora}}
        model = ["11", 0]
    prompt["6"]["inputs"]["model"] = model
    return prompt


class Soak:
    """Drives one server; plain reference latents are computed once per seed and LoRA strength."""

    def __init__(self, server: ComfyServer, rng: random.Random) -> None:
        self.server = server
        self.rng = rng
        self.references: dict[tuple, torch.Tensor] = {}  # (seed, LoRA strength, steps) -> plain latent
        self.prompts = 0
        make_lora(server.models.models_dir / "diffusion_models" / server.models.unet_name,
                  server.models.models_dir / "loras" / LORA)

    def latent(self, run: Run, count_live: bool = False) -> tuple[torch.Tensor | None, dict]:
        """The run's latent (``None`` when interrupted) and, if asked for, the live objects right after it sampled."""
        self.prompts += 1
        prompt_id = self.server.queue(workflow(self.server.models.unet_name, run, f"soak_{self.prompts}", count_live))
        if run.interrupt:
            self._wait_until_running(prompt_id)
            time.sleep(self.rng.uniform(0.0, 0.1))
            self.server.post("/interrupt", {})
        entry = self.server.wait(prompt_id, check=not run.interrupt)
        if entry["status"]["status_str"] != "success":
            return None, {}
        (saved,) = entry["outputs"]["7"]["latents"]
        path = self.server.output_dir / saved["subfolder"] / saved["filename"]
        return load_file(str(path))["latent_tensor"], entry["outputs"][LIVE]["live"][0] if count_live else {}

    def _wait_until_running(self, prompt_id: str, timeout: float = 60.0) -> None:
        """An interrupt sent before the prompt starts would be lost (ComfyUI clears the flag at start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(item[1] == prompt_id for item in self.server.get("/queue")["queue_running"]):
                return
            time.sleep(0.01)

    def reference(self, run: Run) -> torch.Tensor:
        key = (run.seed, run.lora, run.steps)
        if key not in self.references:
            self.references[key], _ = self.latent(Run("plain", run.seed, run.lora, {}, run.steps))
        return self.references[key]

    def free(self) -> dict:
        """``POST /free``, then the live objects once the server has handled it (it does so between prompts)."""
        self.server.post("/free", {"unload_models": True, "free_memory": True})
        time.sleep(0.5)
        entry = self.server.run({LIVE: {"class_type": "GroupOffloadTestLiveObjects", "inputs": {}}})
        return entry["outputs"][LIVE]["live"][0]


def soak(server: ComfyServer, runs: int, seed: int = 0) -> SoakResult:
    """``runs`` random runs (plain references not counted), then a last ``/free``."""
    rng = random.Random(seed)
    driver, result = Soak(server, rng), SoakResult()
    started = time.perf_counter()
    for index in range(runs):
        run = Run.draw(rng)
        latent, live = driver.latent(run, count_live=not result.rss_first_load)
        result.runs += 1
        if live:
            result.rss_first_load = live["rss_bytes"]
        if latent is None:
            result.interrupted += 1
        else:
            result.compared += 1
            if not torch.equal(latent, driver.reference(run)):
                result.wrong_latents.append(f"run {index}: {run}")
        if run.free_after:
            result.frees += 1
            driver.free()
        log.info("run %d/%d: %s", index + 1, runs, run)
    result.live_after_free = driver.free()
    result.rss_after_free = result.live_after_free["rss_bytes"]
    result.seconds = time.perf_counter() - started
    return result


def report(result: SoakResult, runs_arg: int) -> str:
    live = result.live_after_free
    rows = [[result.runs, result.compared, len(result.wrong_latents), result.interrupted, result.frees,
             f"{result.rss_first_load / 2**20:.0f}", f"{result.rss_after_free / 2**20:.0f}",
             f"{100 * result.rss_drift:+.1f} %", live["handles"], live["host_mirrors"], live["diffusion_models"],
             f"{result.seconds:.0f}"]]
    table = markdown_table(["runs", "latents compared", "wrong latents", "interrupted", "/free", "RSS after 1st load (MiB)",
                            "RSS after last /free (MiB)", "RSS drift", "handles", "host mirrors", "diffusion models",
                            "seconds"], rows)
    return (f"`python3 bench/soak.py --runs {runs_arg}`: random API runs against one real ComfyUI server (tiny "
            f"Qwen-Image, CPU): Group Offload node or its loader, random options, LoRA strengths, the node "
            f"bypassed, interrupts, `POST /free`. Every finished latent is compared bit for bit with the plain "
            f"workflow's. Live objects are counted after the last `/free`.\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the figures, leave BENCHMARKS.md as it is")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server:
        result = soak(server, args.runs, args.seed)
    text = report(result, args.runs)
    print(text)
    for wrong in result.wrong_latents:
        print("WRONG", wrong)
    if not args.no_write:
        replace_section("Soak", text)


if __name__ == "__main__":
    main()
