#!/bin/bash
# After ../shared/gpu/bundle.sh, from the project's root: adds to .gpu/ what this project's GPU call needs beyond
# the shared kit, and puts this project's run.sh (bench/gpu/run.sh) in place of the shared one:
#   - the gguf package (pure Python), unpacked into .gpu/site, for ComfyUI-GGUF and the gguf family's files;
#   - ComfyUI-GGUF's source tarball (upstream 795e451), which run.sh unpacks into the GPU machine's custom_nodes.
set -euo pipefail
[[ -d .gpu/site && -f dev.py ]] || { echo "run bash ../shared/gpu/bundle.sh from the project's root first" >&2; exit 1; }
W=${WHEELS:-/tmp/gpu-wheels}; mkdir -p "$W"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$W" "gguf==0.19.0" 2>&1 \
  | grep -v '^WARNING: Location' || true
python3 -m zipfile -e "$W"/gguf-0.19.0-*.whl .gpu/site
cp ../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz .gpu/
cp bench/gpu/run.sh .gpu/run.sh
du -sh .gpu
