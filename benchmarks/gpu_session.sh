#!/usr/bin/env bash
# One call on the lent H200 (see docs/gpu.md): doctor, the CUDA tests, the GPU
# benchmark suite and optimize() wall times. Everything is logged under $OUT.
# Usage (from the repo root, through the device tool): bash benchmarks/gpu_session.sh [bench args]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # pytest & co. travel as wheels: the image has no network
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
{ time python3 -m torchkiln doctor; } 2>&1 | tee "$OUT/doctor.txt"
python3 -m torchkiln doctor --json > "$OUT/doctor.json"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests 2>&1 | tail -25 | tee "$OUT/pytest.txt"
timeout 330 python3 benchmarks/inference.py --device cuda --results "$OUT/RESULTS-gpu.md" --json "$OUT/gpu.json" "$@" 2>&1 \
  | grep -v "^W[0-9]" | tee "$OUT/bench.txt"
if [ -n "${KILN_OPT_TIME:-}" ]; then  # cold, then warm on-disk caches, each in a fresh process
  for i in 1 2; do
    timeout 150 python3 benchmarks/optimize_time.py $KILN_OPT_TIME 2>&1 | tail -1 | tee -a "$OUT/optimize_time.txt"
  done
fi
