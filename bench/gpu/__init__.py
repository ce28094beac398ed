"""GPU benchmark: full-size Qwen-Image through ComfyUI's sampler, this pack against ComfyUI as shipped.

One command, on a machine with CUDA (the call's families in about 7.5 minutes on one H200)::

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

Families, each in its own process, in the order of a GPU call (what users gain first). Each row tells the
parent as it begins (with its time limit) and prints its ``RESULT`` line the moment it ends; a row that passes its
limit or whose process dies gets its RESULT line from the parent, and the family starts again after it, so a
failing row never hides the others (an out-of-memory row says so):

- ``shipped``   ComfyUI 0.33.0 as its main.py starts (Dynamic VRAM, ``cudaMallocAsync`` where it picks it):
                all resident, and ComfyUI as shipped at 24 and 40 GiB;
- ``auto``      this pack's node, ``auto``, on that model at 24 (profiled) and 40 GiB (issue 33, item 1);
- ``fp8``       an fp8 (e4m3fn) checkpoint at 16 GiB: ComfyUI, all resident, this pack ``auto`` and ``stream_all`` p1;
- ``gguf``      full-size GGUF files (Q8_0, Q4_K), ComfyUI-GGUF as shipped against this pack (``families/gguf.py``);
- ``compile-*`` torch.compile, five systems in five processes (``compile`` names them all; ``families/compile.py``);
- ``box``       the user's machine: a 20.4 GB fp8 file, less RAM, a cold page cache (``families/box.py``);
- ``te-*``      the text encoder (issue 46): a 15.5 GB Qwen2.5-VL-7B-shaped bf16 file at a 12 GiB card, ComfyUI's
                Dynamic VRAM, legacy, pageable, ``--lowvram`` (CPU encode) and this pack's node (prefetch 0, 1) and
                loader, seven processes (``text_encoder`` names them all, a call of their own: 375 s of shares;
                ``families/text_encoder.py``): first encode, s per prompt change, steady encode, peak anonymous RAM,
                the conditioning's max |Δ| against ComfyUI's;
- ``legacy``    ComfyUI with ``--disable-dynamic-vram``: its legacy partial load at 24 and 16 GiB;
- ``pack``      this pack's earlier rows: ``auto`` and ``stream_all`` p1/p2 at each cap, pins refused or capped,
                a host budget of 25 %;
- ``lora``, ``lora-native``  a LoRA on a third of the blocks, under cudaMallocAsync and torch's own allocator;
- ``baselines`` bare forwards outside ComfyUI's sampler: the copy-back baseline (diffusers' group offloading
                before the fix) and diffusers 0.42's own, ``use_stream`` False and True.

Per row: s/step, × all resident, streamed GB/step, achieved GB/s and its share of the measured
pinned peak, step ÷ max(compute, streamed bytes ÷ pinned bandwidth), GPU wait ms/step, model calls
per step, pinned host bytes, peak host RSS. JSON, a markdown table, a PNG chart and the profiled
step's chrome trace (with the share of that step in which copies and kernels overlapped) go to the
output folder.

Rooms (``bench/gpu/``; ``bench/gpu_benchmark.py`` is the command)::

    config     the run's configuration, a row, its RESULT line
    weights    seeded random weights in the shapes of ComfyUI's Qwen-Image
    comfyui    ComfyUI started in this process as main.py starts it; the model through its loader
    balloon    the caps: the card's, and the host's RAM (a smaller machine)
    files      full-size model files on the local disk: fp8 safetensors, GGUF, any model's tensors by shape
    timing     step clock, bandwidths, one step's trace and its overlap arithmetic
    sampling   one row through ComfyUI's sampler; this pack's rows and ComfyUI's own
    families/  one room per family (the ``--worker`` side)
    results    derived figures, markdown, chart, JSON
    runner     the parent: one process per family, each row's limit, the time budget, the command line
    kit.sh     adds gguf and ComfyUI-GGUF to the shared GPU kit's .gpu/, and this project's run.sh
    run.sh     the shared kit's run.sh with those two added and the 9-minute budget (CUDA tests 60 s)
"""
