#!/bin/bash
# The GPU check, from the project's root on the offline CUDA machine (see ../shared/gpu/README.md):  bash .gpu/run.sh
# REHEARSE=1 PY=<Python 3.12 + torch 2.11 venv> runs the same stages on the CPU first.
# This project's copy of the shared kit's run.sh (bench/gpu/kit.sh puts it in .gpu/): it also unpacks ComfyUI-GGUF
# into custom_nodes and checks that gguf imports; the CUDA tests get 60 s and the benchmark 460 s by default, the
# whole under 9 minutes; the benchmark's families run in the order of what users gain (bench/gpu/runner.py).
set -u
R=$(pwd); O=${OUT:-/tmp/gpu-out}; mkdir -p "$O"
exec > >(tee -a "$O/run.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$R/.gpu/site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}; REH=${REHEARSE:-0}
T0=$(date +%s); stage() { echo; echo "=== $1 (t=$(( $(date +%s) - T0 )) s)"; }

stage environment
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1 | head -3
$PY -c "import torch,sys;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'gpu',torch.cuda.is_available() and torch.cuda.get_device_name())"
C=/tmp/comfyui-gpu; rm -rf $C; mkdir -p $C; tar -xzf "$R"/.gpu/ComfyUI-0.33.0-*.tar.gz -C $C
C=$(dirname "$(find $C -maxdepth 3 -name comfyui_version.py | head -1)")
ln -sfn "$R" "$C/custom_nodes/group-offload-no-copy-back"
for t in "$R"/.gpu/ComfyUI-GGUF-*.tar.gz; do [[ -f $t ]] && tar -xzf "$t" -C "$C/custom_nodes"; done
export COMFYUI_PATH=$C
$PY -c "import torchsde, comfy_aimdo, comfy_kitchen, diffusers, gguf; print('ComfyUI at $C; bundle imports ok')"

# Knobs: SKIP_TESTS=1 skips the tests; TESTS_S / BENCH_S bound each stage (s); BENCH_ARGS is passed to the benchmark
# (e.g. BENCH_ARGS="--families pack,shipped"). The browser tests import playwright, which that machine lacks: one
# collection error would stop the whole cuda run, so they are left out here.
TESTS_S=${TESTS_S:-60}; BENCH_S=${BENCH_S:-460}
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  stage "CUDA tests"
  if [[ $REH == 1 ]]; then SEL=(-m "not cuda and not slow and not browser" tests/core/test_core_engine.py); else SEL=(-m cuda tests); fi
  timeout "$TESTS_S" $PY -m pytest -c tests/pytest.ini -q -p no:cacheprovider --ignore-glob='tests/server/test_browser*.py' \
    "${SEL[@]}" 2>&1 | tail -30
fi

stage "GPU benchmark"
if [[ $REH == 1 ]]; then B=(--smoke); else B=(); fi
# shellcheck disable=SC2086
timeout "$BENCH_S" $PY bench/gpu_benchmark.py "${B[@]}" --budget-s $(( BENCH_S - 10 )) ${BENCH_ARGS:-} --out "$O" 2>&1 \
  | grep -v "comfy_kitchen backend"

stage done
