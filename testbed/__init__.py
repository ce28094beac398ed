"""The test bed: what the tests, the benchmarks and the demo stand on.

ComfyUI booted in this process (``comfy_boot``) or as a live server on loopback (``live_server``), the pack's
modules as ComfyUI loaded them (``pack_modules``), the nodes run in-process (``run_nodes``, ``node_runs``,
``gguf_runs``), fixture models and files made at test time (``fixture_models``, ``dit_families``, ``other_models``, ``quantized_files``,
``gguf_files``, ``lora_fixture``, ``core_models``), faults to inject (``core_faults``), stand-ins for what a machine
lacks (``fake_cudart``, ``stream_checker``, ``memory_compiler``, ``stand_ins``, ``gpu_decisions``), the front end in
Chromium (``browser``, ``ui_workflows``), host memory readings (``host_memory``) and the drivers run in a process of
their own (``*_driver``). ``comfy_testnodes`` and ``stand_in_models`` are node packs ComfyUI loads in tests only.

It is imported as a package from the repository root, which goes on ``sys.path`` after ComfyUI's checkout (pytest
run from the root; ``bench/bench_paths.py``): the root's ``nodes/`` must not shadow ComfyUI's ``nodes.py``.
"""
