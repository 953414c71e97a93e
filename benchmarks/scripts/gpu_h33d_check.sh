#!/usr/bin/env bash
# Every mode on the GPU and PD with GPU-resident pools, on ONE H200 (check: about 5 minutes; suite: at most 5 more).
#
#   PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/ibverbs/usr/lib/x86_64-linux-gnu bash benchmarks/scripts/gpu_h33d_check.sh [check|suite|all]
#
# Needs FlashMLA (sgl-flash-mla 1.0.0) and Mooncake's non-cuda wheel importable (e.g. pip --no-deps --target
# /tmp/site) and Debian's libibverbs1 on LD_LIBRARY_PATH (dpkg -x libibverbs1_*.deb /tmp/ibverbs); wheels and the
# .deb in .whl/ are set up by benchmarks/gpu_flashmla.sh when they are not.
#   check (default): gpu_flashmla.sh's pd phase -- the demo's PD of CUDA pools (decode group on the same GPU, the
#         hand-off through pinned host memory), transformers and reference models, and bench_transfer --device cuda
#         (GB/s of the hand-off against a device-to-device copy; transfer_h200x1_<date>.jsonl) -- then the new GPU
#         test files: the mode matrix (tests/test_gpu_matrix.py) and the hand-off of CUDA pools.
#   suite: gpu_flashmla.sh's gpu phase, python -m pytest -m gpu (every GPU case of the suite; target <= 5 minutes).
# Logs and results under $OUT (default benchmarks/results/run-<date>/h33d); the exit status is 0 when every step was.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/run-$(date +%F)/h33d}
phase=${1:-check}
case $phase in check|suite|all) ;; *) echo "usage: gpu_h33d_check.sh [check|suite|all]"; exit 2;; esac
mkdir -p "$OUT"
rc=0
if [ "$phase" != suite ]; then
  OUT=$OUT/pd bash benchmarks/gpu_flashmla.sh pd || rc=1
  mkdir -p "$OUT/new_tests"
  t0=$(date +%s)
  timeout 200 python -m pytest -m gpu -q -rs -s -p no:cacheprovider --durations=15 tests/test_gpu_matrix.py \
    tests/test_transfer_handoff_cuda.py tests/test_gpu_marker.py > "$OUT/new_tests/new_gpu_tests.log" 2>&1
  s=$?
  echo "new_gpu_tests rc=$s 200s-limit took=$(( $(date +%s) - t0 ))s" | tee "$OUT/new_tests/steps.txt"
  [ $s -eq 0 ] || rc=1
  grep -E "decode, (torch|triton|flashmla):" "$OUT/new_tests/new_gpu_tests.log" | head -n 40
  grep -E "passed|failed|error" "$OUT/new_tests/new_gpu_tests.log" | tail -n 3
fi
if [ "$phase" != check ]; then
  OUT=$OUT/suite bash benchmarks/gpu_flashmla.sh gpu || rc=1
fi
echo "== gpu_h33d_check $phase: $([ $rc -eq 0 ] && echo green || echo 'NOT green') ($OUT)"
exit $rc
