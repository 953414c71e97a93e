#!/usr/bin/env bash
# The prefill path's two one-pass ops (dtkv::dequantize_mla_rows, dtkv::rope_interleave_into) timed, and the
# 61-layer decode on ONE H200 (about 9 minutes; H100 numbers are not the decode target's): their CUDA tests, the ops
# alone against the torch paths they replace and the copy ceiling (bench_ops), the runtime's prefill at 32K and 128K
# with both ops and with neither in one lease (runtime_ab.py; first "neither", so that a slower machine state does
# not favour the change), then the 61-layer decode step at 32K / batch 1 in both modes.
#
#   PYTHONPATH=/tmp/site:$PWD OUT=/root/out bash benchmarks/scripts/gpu_h33f_check.sh
#
# Needs torch 2.11+ with CUDA, Triton 3.6+, transformers 5.17 and FlashMLA (sgl-flash-mla 1.0.0, e.g. installed with
# --no-deps into /tmp/site). Logs and results go to $OUT (default benchmarks/results/run-<date>/h33f); each step has
# a deadline; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/run-$(date +%F)/h33f}
mkdir -p "$OUT"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import transformers; print('transformers', transformers.__version__)";
  python -c "import flash_mla; print('flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
: > "$OUT/steps.txt"
STEP_DIR=$OUT
source benchmarks/_steps.sh   # step NAME SECONDS CMD...: run with a deadline, log to $OUT/NAME.log, record the exit status
step cuda_tests 120 python -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/test_ops_dequantize_mla_rows.py tests/test_integration_transformers_query_rope.py
step parity_tests 100 python -m pytest -q -rs -p no:cacheprovider tests/test_attention_cuda.py -k transformers
step bench_ops 90 python benchmarks/bench_ops.py --ops dequantize_mla_rows rope_interleave_into --out "$OUT"
PREFILL=(--graph --attention flashmla --phases prefill --adapters transformers --prefill 32768x8192,131072x8192
         --no-kernels --budget-s 100 --out-dir "$OUT")
step prefill_neither 130 python benchmarks/scripts/runtime_ab.py --variant neither -- "${PREFILL[@]}"
step prefill_both 130 python benchmarks/scripts/runtime_ab.py --variant both -- "${PREFILL[@]}"
step decode_61 120 python benchmarks/bench_runtime.py --graph --attention flashmla --phases decode \
  --adapters transformers --layers 61 --long-layers 0 --decode-contexts 32768 --batches 1 --no-kernels \
  --budget-s 90 --out-dir "$OUT/decode61"

echo; echo "== summary ($OUT)"
cat "$OUT/steps.txt"
grep -hE "passed|failed|error" "$OUT/cuda_tests.log" "$OUT/parity_tests.log" 2>/dev/null | tail -n 4
grep -hE "dequantize_mla_rows|rope_interleave_into" "$OUT"/ops_*.md 2>/dev/null | head -n 12
for v in neither both; do
  echo "-- $v"; grep -hE '"phase": "prefill"' "$OUT/$v"/runtime_*.jsonl 2>/dev/null | cut -c1-500
done
grep -hE '"phase": "decode"' "$OUT"/decode61/runtime_*.jsonl 2>/dev/null | cut -c1-500
