#!/usr/bin/env bash
# The prefill path at production speed, on ONE H200 (about 4-5 minutes, most of it Triton compiles): the CUDA tests of the extend indexer's
# selection (dtkv::logits_topk, dtkv::quantize_indexer_queries), of sync-free planning and run phase, and of the
# transformers model across attention backends; the selection alone against the packed-key path it replaces and
# torch.topk (bench_logits_topk, with a launch sweep); the runtime's prefill at 32K and 128K (bench_runtime).
#
#   PYTHONPATH=/tmp/site:$PWD OUT=/root/out bash benchmarks/scripts/gpu_h33e_check.sh
#
# Needs torch 2.11+ with CUDA, Triton 3.6+, transformers 5.17 and FlashMLA (sgl-flash-mla 1.0.0, e.g. installed with
# --no-deps into /tmp/site). Logs and results go to $OUT (default benchmarks/results/run-<date>/h33e); each step has
# a deadline; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/run-$(date +%F)/h33e}
mkdir -p "$OUT"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import flash_mla; print('flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
: > "$OUT/steps.txt"
STEP_DIR=$OUT
source benchmarks/_steps.sh   # step NAME SECONDS CMD...: run with a deadline, log to $OUT/NAME.log, record the exit status
step cuda_tests 120 python -m pytest -q -rs -p no:cacheprovider \
  tests/test_ops_logits_topk.py tests/test_ops_quantize_indexer_queries.py tests/test_runtime_prefill_cuda.py \
  tests/test_ops_indexer_logits.py -k "cuda or prefill_cuda or synchronize"
step parity_tests 100 python -m pytest -q -rs -p no:cacheprovider tests/test_attention_cuda.py -k transformers
step bench_logits_topk 120 python benchmarks/bench_logits_topk.py --sweep --reps 3 --out-dir "$OUT"
step bench_runtime 150 python benchmarks/bench_runtime.py --phases prefill --adapters transformers \
  --prefill 32768x8192,131072x8192 --out-dir "$OUT"

echo; echo "== summary ($OUT)"
cat "$OUT/steps.txt"
grep -hE "passed|failed|error" "$OUT/cuda_tests.log" "$OUT/parity_tests.log" 2>/dev/null | tail -n 4
grep -h "SUMMARY" "$OUT/bench_logits_topk.log" 2>/dev/null
grep -hE '"phase": "prefill"' "$OUT"/runtime_*.jsonl 2>/dev/null | cut -c1-600
grep -h "TARGET" "$OUT"/runtime_*.md 2>/dev/null
grep -hA12 "Where the device time went" "$OUT"/runtime_*.md 2>/dev/null | head -n 6
