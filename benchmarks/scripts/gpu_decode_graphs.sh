#!/usr/bin/env bash
# The runtime's decode as CUDA graphs on ONE H200 (torch 2.11, Triton 3.6, FlashMLA sgl-flash-mla 1.0.0; about 8
# minutes): the CUDA cases of the graph tests, then bench_runtime's graph decode at 32K and 128K x batch 1 and 16,
# both decode modes, both adapters (and the 61-layer case at 32K / batch 1), then the same cases eager for contrast.
#
#   PYTHONPATH=/tmp/site:$PWD OUT=/some/dir bash benchmarks/scripts/gpu_decode_graphs.sh [tests|graph|eager|all]
#
# FlashMLA comes from /tmp/site (pip install --no-deps --target /tmp/site sgl_flash_mla-1.0.0-*.whl). Logs and
# results go to $OUT (default benchmarks/results/run-<date>/graphs); each step has a deadline; the targets of the
# graph run (bench_runtime --targets) and a short summary are printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/run-$(date +%F)/graphs}
mkdir -p "$OUT"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import flash_mla; print('flash_mla', flash_mla.__version__)";
  python -c "from dtkv.attention import available_backends; print(available_backends('cuda'))";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
: > "$OUT/steps.txt"
STEP_DIR=$OUT
source benchmarks/_steps.sh   # step NAME SECONDS CMD...: run with a deadline, log to $OUT/NAME.log, record the exit status
phase=${1:-all}
case $phase in all|tests|graph|eager) ;; *) echo "usage: gpu_decode_graphs.sh [all|tests|graph|eager]"; exit 2;; esac
run() { [ "$phase" = all ] || [ "$phase" = "$1" ]; }
# 1. the CUDA cases: captured == emulated bitwise (both adapters, both modes, a padded bucket, requests finishing and
#    joining, pages outgrowing buckets, a pool whose buffers moved, DeepSeek-V3.2 dims on FlashMLA), and the
#    one-rank FlashMLA sharded decode (bf16 / fp32 models, the reference model) on the real wheel
run tests && step graph_tests 170 python -m pytest -q -rs -p no:cacheprovider tests/test_runtime_graphs.py -k "cuda or captured"
run tests && step decode_gpu_tests 120 python -m pytest -q -rs -p no:cacheprovider tests/test_decode_gpu.py
# 2. the issue's decode cases with graphs (rows: graph true, graph_eager_steps 0, gpu_busy_share, dtkv_ms_per_layer
#    against bench_decode's graph step per layer, the 61-layer step at 32K / batch 1)
run graph && step bench_graph 330 python benchmarks/bench_runtime.py --phases decode --graph \
  --decode-contexts 32768,131072 --batches 1,16 --budget-s 310 --out-dir "$OUT/graph"
# 3. the same decode cases eager (the contrast: host-bound steps)
run eager && step bench_eager 150 python benchmarks/bench_runtime.py --phases decode --adapters transformers \
  --decode-contexts 32768 --batches 1,16 --long-layers 0 --budget-s 130 --out-dir "$OUT/eager"

echo; echo "== targets (graph run)"
for f in "$OUT"/graph/runtime_*.jsonl; do [ -e "$f" ] && python benchmarks/bench_runtime.py --targets "$f"; done
echo; echo "== summary ($OUT)"
cat "$OUT/steps.txt"
