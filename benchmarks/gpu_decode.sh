#!/usr/bin/env bash
# The decode step on GPUs: the CUDA tests, then benchmarks/bench_decode.py. Run from the repository root.
#   bash benchmarks/gpu_decode.sh            # tests, --quick, the full grid (one H200: ~8 minutes in all)
#   bash benchmarks/gpu_decode.sh quick      # tests and --quick only (~4 minutes)
#   bash benchmarks/gpu_decode.sh sweep      # the indexer kernel's launches at 4 shapes (~3 minutes; one process)
#   NP=2 bash benchmarks/gpu_decode.sh full  # 2 GPUs: sharded decode with NCCL and symmetric memory
# Logs and results go to $OUT (default benchmarks/results/run-<date>)/decode; the summary is printed last.
# FlashMLA: pip install --no-deps --target /tmp/site .whl/sgl_flash_mla-1.0.0-*.whl and PYTHONPATH=/tmp/site.
set -uo pipefail
phase=${1:-all}
NP=${NP:-1}
OUT=${OUT:-benchmarks/results/run-$(date +%F)}
R="$OUT/decode"
mkdir -p "$R"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import flash_mla; print('flash_mla', getattr(flash_mla, '__version__', '?'))" || echo "flash_mla missing";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$R/env.txt" 2>&1
: > "$R/steps.txt"
STEP_DIR=$R
. benchmarks/_steps.sh  # step NAME SECONDS CMD...: a deadline, $R/NAME.log, the exit status in steps.txt
TR="torchrun --nproc-per-node $NP"
COMM=nccl
[ "$NP" -gt 1 ] && COMM=nccl,symm_mem
tests() {
  step gpu_tests 300 python -m pytest -q -p no:cacheprovider -rs tests/test_decode_gpu.py
}
case $phase in
  quick) tests; step bench_quick 240 $TR benchmarks/bench_decode.py --quick --comm $COMM --out-dir "$R/quick" ;;
  full) step bench 420 env OUT="$R" $TR benchmarks/bench_decode.py --comm $COMM --out-dir "$R/full" ;;
  sweep)
    step indexer_sweep 300 python benchmarks/bench_indexer_scores.py --out-dir "$R/sweep" ;;
  all)
    tests
    step bench_quick 240 $TR benchmarks/bench_decode.py --quick --comm $COMM --out-dir "$R/quick"
    step bench 420 env OUT="$R" $TR benchmarks/bench_decode.py --comm $COMM --out-dir "$R/full" ;;
  *) echo "usage: gpu_decode.sh [all|quick|full|sweep]"; exit 2 ;;
esac
echo "== steps"; cat "$R/steps.txt"
[ -f "$R/gpu_tests.log" ] && { echo "== tests"; tail -n 8 "$R/gpu_tests.log"; }
for log in bench_quick bench indexer_sweep; do
  [ -f "$R/$log.log" ] && { echo "== $log"; sed -n '/^summary/,$p' "$R/$log.log" | tail -n 40; grep -m3 -i "error\|traceback" "$R/$log.log"; }
done
exit 0
