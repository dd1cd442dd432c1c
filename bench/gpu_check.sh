#!/usr/bin/env bash
# The GPU checks in one call (issue 28, item 7), on a machine with one CUDA device:
#
#     bash bench/gpu_check.sh            # from anywhere; it runs from the repository root
#
# 1. the suite's CUDA tests (marked `cuda`, skipped elsewhere): pytest -m cuda on the files that
#    hold them, at most 180 s;
# 2. python -m bench.gpu (one table: host syncs and ratios against eager), at most 300 s.
# Both outputs go to $OUT (default ./gpu_out): env.txt, pytest_cuda.txt, bench_gpu.txt. opwatch
# need not be installed (PYTHONPATH is the repository root). Whole script: under 8 minutes.
# BENCH_ARGS (e.g. --quick) goes to bench.gpu.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi -L 2>&1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  git -C "$ROOT" log -1 --format='commit %H %s' 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The files that hold tests marked cuda; -m cuda picks those tests out of them.
files=$(grep -rlE --include='test_*.py' 'mark\.cuda' tests | sort)
echo "== pytest -m cuda: $files"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda $files > "$OUT/pytest_cuda.txt" 2>&1
status=$?
echo "exit status $status" >> "$OUT/pytest_cuda.txt"
tail -n 40 "$OUT/pytest_cuda.txt"

echo "== python -m bench.gpu ${BENCH_ARGS:-}"
timeout 300 "$PY" -m bench.gpu ${BENCH_ARGS:-} > "$OUT/bench_gpu.txt" 2>&1
bench_status=$?
echo "exit status $bench_status" >> "$OUT/bench_gpu.txt"
cat "$OUT/bench_gpu.txt"
exit $(( status != 0 || bench_status != 0 ))
