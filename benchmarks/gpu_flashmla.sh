#!/usr/bin/env bash
# FlashMLA behind dtkv.attention on ONE H200 (about 5 minutes): the seam's CUDA tests, bench_flashmla, the runtime
# on FlashMLA (bench_runtime: prefill at 32K, decode at 32K, both adapters, cp=1), plus the demo with --attention
# flashmla.
#
#   pip install -q --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_flashmla.sh
#
# An optional phase runs one part: tests | bench | runtime | demo (default: all; the step deadlines add up to 9.8
# minutes, the expected total is about 5).
# FlashMLA is the PyPI wheel sgl-flash-mla==1.0.0, installed with --no-deps: its metadata asks for torch>=2.14.1, which
# would replace the image's torch; the wheel loads on torch 2.11 through the stable ABI. Without an importable
# flash_mla, a wheel in .whl/ is installed to /tmp/site first. Logs and results go to $OUT (default
# benchmarks/results/run-<date>/flashmla); each step has a deadline; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/run-$(date +%F)/flashmla}
mkdir -p "$OUT"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if ! python -c "import flash_mla" 2>/dev/null; then
  for whl in .whl/sgl_flash_mla-*.whl .whl/expecttest-*.whl; do
    [ -e "$whl" ] && pip install -q --no-deps --target /tmp/site "$whl"
  done
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import flash_mla; print('flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())";
  python -c "from dtkv.attention import available_backends; print(available_backends('cuda'))";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
: > "$OUT/steps.txt"
step() {  # step NAME SECONDS CMD...: run with a deadline, log to $OUT/NAME.log, record the exit status
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ${secs}s-limit took=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
}
phase=${1:-all}
case $phase in all|tests|bench|runtime|demo) ;; *) echo "usage: gpu_flashmla.sh [all|tests|bench|runtime|demo]"; exit 2;; esac
run() { [ "$phase" = all ] || [ "$phase" = "$1" ]; }
run tests && step cuda_tests 140 python -m pytest -q -rs -s -p no:cacheprovider tests/test_attention_cuda.py
run bench && step bench_flashmla 150 python benchmarks/bench_flashmla.py --out-dir "$OUT"
run runtime && step bench_runtime 160 python benchmarks/bench_runtime.py --attention flashmla --phases prefill,decode \
  --prefill 32768x8192 --decode-contexts 32768 --batches 1 --long-layers 0 --budget-s 140 --out-dir "$OUT"
run demo && step demo_reference 70 python -m dtkv.demo --cp 1 --device cuda --attention flashmla --kv-dtype fp8 \
  --tokens 1024 --json
run demo && step demo_deepseek 70 python -m dtkv.demo --cp 1 --device cuda --attention flashmla --model deepseek-v32 --json

echo; echo "== summary ($OUT)"
cat "$OUT/steps.txt"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" 2>/dev/null | tail -n 2
grep -hE "^(flashmla vs|reference model,|deepseek-v32,|glm5,|FlashMLA, a query)" "$OUT/cuda_tests.log" 2>/dev/null | head -n 30
grep -h "TARGET" "$OUT"/flashmla_*.md "$OUT"/runtime_*.md 2>/dev/null
grep -hE "^\| (sparse_prefill|sparse_decode) " "$OUT"/flashmla_*.md 2>/dev/null
grep -h '"parity"' "$OUT"/demo_*.log 2>/dev/null | cut -c1-300
