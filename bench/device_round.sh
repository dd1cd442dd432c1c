#!/usr/bin/env bash
# One device call for the round's figures (issues 28 and 29), on a machine with one CUDA device
# and many CPU cores: the distributed guard bench on 2 gloo ranks that do not share cores, the
# compiled bench on CPU, then the suite's CUDA tests and bench.gpu's compiled part for two workloads.
# Each part is bounded; outputs go to $OUT (default ./gpu_out). Whole script: under 9 minutes.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{ date -u; nproc; "$PY" -c "import torch; print('torch', torch.__version__)"; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
for width in 256 1024; do
  rounds=$([ "$width" = 256 ] && echo 15 || echo 9)
  OMP_NUM_THREADS=1 timeout 110 "$PY" -m bench.guard_distributed --width "$width" --rounds "$rounds" > "$OUT/distributed_$width.txt" 2>&1
  tail -n 30 "$OUT/distributed_$width.txt"
done
OMP_NUM_THREADS=1 timeout 45 "$PY" -m bench.compiled 9 > "$OUT/compiled_cpu.txt" 2>&1
tail -n 4 "$OUT/compiled_cpu.txt"
files=$(grep -rlE --include='test_*.py' 'mark\.cuda' tests | sort)
HF_HUB_OFFLINE=1 timeout 120 "$PY" -m pytest -q -o addopts="" -p no:cacheprovider -m cuda $files > "$OUT/pytest_cuda.txt" 2>&1
tail -n 5 "$OUT/pytest_cuda.txt"
for workload in small-fp32 large-bf16; do
  timeout 90 "$PY" -m bench.gpu --part compile --workload "$workload" --quick > "$OUT/compile_$workload.txt" 2>&1
  tail -n 12 "$OUT/compile_$workload.txt"
done
