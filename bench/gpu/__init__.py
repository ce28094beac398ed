"""GPU benchmark: full-size Qwen-Image through ComfyUI's sampler, this pack against ComfyUI as shipped.

One command, on a machine with CUDA (about 6 minutes on one H200)::

    .venv/bin/python bench/gpu_benchmark.py            # results in $OUT, else .artifacts/gpu
    .venv/bin/python bench/gpu_benchmark.py --smoke    # every family and row, tiny, on the CPU

The model is ComfyUI's own Qwen-Image (60 blocks, 40.8 GB in bf16) with seeded random weights, handed
to ComfyUI's ``load_diffusion_model_state_dict`` as a loaded file would be. Every row samples it
through ``comfy.sample.sample`` (KSampler's path: ``load_models_gpu`` with the latent's memory
estimate, cond and uncond batched when ComfyUI finds room) at 1664×928 with 128 text tokens, euler,
cfg 4: one warm-up step (it includes the load), then the timed steps, each ended by a device sync.

**The cap is a balloon**: before a capped row, (total − cap) bytes are allocated on the card and
held, so that every allocator and every free-memory query (ComfyUI's, comfy-aimdo's, the pack's
``auto``) sees a card of that size. Caps: 40 and 24 GiB in bf16, 16 GiB in fp8.

Families, each in its own process (one per way ComfyUI starts), each printing one ``RESULT`` line
per row the moment the row ends, so that a row that runs out of time or memory loses only itself:

- ``shipped``   started as ComfyUI 0.33.0's main.py starts (comfy-aimdo's Dynamic VRAM and the
                ``cudaMallocAsync`` allocator where it picks them): all resident (uncapped); ComfyUI
                as shipped at each cap; this pack's node (as a user wires it, on the Dynamic VRAM
                model) with ``auto``, ``stream_all`` prefetch 1 and 2 at each cap; one profiled step;
- ``legacy``    ComfyUI with ``--disable-dynamic-vram``: its legacy partial load at each cap;
- ``fp8``       as ``shipped``, with an fp8 (e4m3fn) checkpoint, at 16 GiB;
- ``baselines`` bare forwards of the same model outside ComfyUI's sampler: the copy-back baseline
                (diffusers' group offloading before the fix) and diffusers 0.42's own group
                offloading, ``use_stream`` False and True (skipped when not importable).

Per row: s/step, × all resident, streamed GB/step, achieved GB/s and its share of the measured
pinned peak, step ÷ max(compute, streamed bytes ÷ pinned bandwidth), GPU wait ms/step, model calls
per step, pinned host bytes, peak host RSS. JSON, a markdown table, a PNG chart and the profiled
step's chrome trace (with the share of that step in which copies and kernels overlapped) go to the
output folder.

Rooms (``bench/gpu/``; ``bench/gpu_benchmark.py`` is the command)::

    config     the run's configuration, a row, its RESULT line
    weights    seeded random weights in the shapes of ComfyUI's Qwen-Image
    comfyui    ComfyUI started in this process as main.py starts it; the model through its loader
    balloon    the caps
    timing     step clock, bandwidths, one step's trace and its overlap arithmetic
    sampling   one row through ComfyUI's sampler; this pack's rows and ComfyUI's own
    families/  one room per family (the ``--worker`` side)
    results    derived figures, markdown, chart, JSON
    runner     the parent: one process per family, the time budget, the command line
"""
