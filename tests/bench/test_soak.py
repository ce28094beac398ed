"""A short soak in the suite: random API runs stay exact and leave nothing behind (``bench/soak.py``
runs the long one)."""
from __future__ import annotations

from soak import soak

RUNS = 24


def test_random_api_runs_match_plain_and_free_gives_everything_back(comfy_server):
    result = soak(comfy_server, RUNS, seed=3)
    assert result.wrong_latents == []
    assert result.runs == RUNS and result.compared + result.interrupted == RUNS
    assert result.interrupted >= 1 and result.frees >= 1, "the seed must draw interrupts and frees"
    live = result.live_after_free
    assert (live["handles"], live["host_mirrors"], live["offload_patchers"], live["diffusion_models"]) == (0, 0, 0, 0)
    assert result.rss_drift <= 0.05, f"RSS {result.rss_first_load} -> {result.rss_after_free} bytes"
