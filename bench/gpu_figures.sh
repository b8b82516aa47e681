#!/usr/bin/env bash
# Every GPU figure in one run of under 8 minutes: install, the GPU tests, the benches.
#
# On the machine with PyPI (before): download what the GPU image lacks, for its Python:
#     bash bench/gpu_figures.sh --fetch-wheels        # into .gpu_wheels/ (git-ignored)
# On the GPU machine (the device tool carries .gpu_wheels), from the repository root:
#     OUT=/some/dir bash bench/gpu_figures.sh
# Writes into $OUT (default gpu_out/): device.txt, tests.txt, bench_gpu.txt + gpu.json,
# tiers.txt + tiers_cuda.json (the step taken apart at 2M x 128, 16,384 bags x 16, and at
# 1M x 64, 8,192 x 20, against the cache-free torch loop), train.txt (the DLRM job on the
# GPU and on the host's CPU).  Each part has its own time limit, so one that hangs still
# leaves the others' figures; the whole stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu_wheels}
if [ "${1:-}" = "--fetch-wheels" ]; then
    for py in 311 312 313; do
        python -m pip download --quiet --only-binary=:all: --python-version "$py" -d "$WHEELS" \
            "numpy>=2.0,<2.5" lmdb zstandard pytest hypothesis || exit 1
    done
    exit 0
fi
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
start=$(date +%s)
part() { echo "== $1 at $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"; }

part install
# numba-cuda needs numpy < 2.5; lmdb and zstandard are not in the image
python -m pip install --quiet --no-index --find-links "$WHEELS" "numpy>=2.0,<2.5" lmdb zstandard pytest hypothesis \
    >> "$OUT/log.txt" 2>&1
python -m pip install --quiet --no-deps --no-build-isolation -e . >> "$OUT/log.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
python -c "import platform, torch, cupy; print(platform.python_version(), torch.__version__, cupy.__version__)" \
    >> "$OUT/device.txt" 2>&1

part tests
timeout 150 python -m pytest -q -p no:cacheprovider tests/step/device/test_gpu.py tests/step/device/test_device_path.py \
    tests/step/device/test_cuda_kernels.py tests/tiers/test_moves.py > "$OUT/tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.txt"

part bench_gpu
timeout 110 python bench/bench_gpu.py --json "$OUT/gpu.json" > "$OUT/bench_gpu.txt" 2>&1

part bench_tiers
timeout 90 python bench/bench_tiers.py --device cuda --rows 2000000 --dim 128 --bags 16384 --bag-size 16 \
    --configs resident,ddr --fresh-batch 0 --json "$OUT/tiers_cuda.json" > "$OUT/tiers.txt" 2>&1
timeout 60 python bench/bench_tiers.py --device cuda --configs resident,ddr --fresh-batch 0 \
    --json "$OUT/tiers_cuda_1m.json" >> "$OUT/tiers.txt" 2>&1

part train
for dev in cuda cpu; do
    rm -rf "$OUT/run_$dev"
    timeout 45 tiered-emb train --device "$dev" --run-dir "$OUT/run_$dev" --quiet >> "$OUT/train.txt" 2>&1
    echo "train --device $dev rc=$?" >> "$OUT/train.txt"
done
part done
