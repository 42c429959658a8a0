#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a GPU (a session's device machine):
# the `cuda`-marked tests, then bench/gpu.py (CUDA tensors: shardwise against DCP, and the
# local tier's restore). Logs go to $OUT when it is set (the device tool's output folder).
#
# That machine has its own PyTorch and most of our dependencies, and no network: the wheels
# it lacks travel in .whl/ (ignored by git). Here, once per session:
#     bash bench/gpu_check.sh --fetch
# then there, carrying .whl:
#     bash bench/gpu_check.sh            (about 3 minutes on an H200, start not counted)
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--fetch" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    # orjson: the one runtime dependency the device image lacks (its Python is 3.12).
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl orjson
fi

out="${OUT:-/tmp/shardwise-gpu-check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$out/gpu.txt"

status=0
# Only the files that hold cuda tests: the others may import what the device image lacks
# (moto, s3fs, torchtitan), and one collection error would stop every test.
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
timeout 300 python3 -m pytest -m cuda -q -p no:cacheprovider "${files[@]}" 2>&1 |
    tee "$out/cuda-tests.log" || status=1
timeout 240 python3 bench/gpu.py --quick 2>&1 | tee "$out/gpu-bench.log" || status=1
exit "$status"
