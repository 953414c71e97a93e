#!/usr/bin/env bash
# FlashMLA behind dtkv.attention on ONE H200: the seam's CUDA tests, bench_flashmla, the runtime on FlashMLA
# (bench_runtime: prefill at 32K, decode at 32K, both adapters, cp=1), the demo with --attention flashmla, PD of CUDA
# pools (the demo's decode group on the same GPU, bench_transfer --device cuda) and the suite's GPU cases (-m gpu).
#
#   pip install -q --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_flashmla.sh
#
# An optional phase runs one part: tests | bench | runtime | demo | pd | gpu (default: all; the step deadlines add up
# to about 19 minutes, the expected total is about 11: run the phases apart where a command may take 10 at most).
# PD needs Mooncake: its non-cuda wheel importable (in /tmp/site) and Debian's libibverbs1 on LD_LIBRARY_PATH; with a
# .whl/mooncake_transfer_engine_non_cuda-*.whl and a .whl/libibverbs1_*.deb beside the others, they are set up here
# (pip --target /tmp/site, dpkg -x into /tmp/ibverbs).
# FlashMLA is the PyPI wheel sgl-flash-mla==1.0.0, installed with --no-deps: its metadata asks for torch>=2.14.1, which
# would replace the image's torch; the wheel loads on torch 2.11 through the stable ABI. Without an importable
# flash_mla, a wheel in .whl/ is installed to /tmp/site first; likewise expecttest and pytest-xdist (with execnet:
# pyproject's addopts run the tests in xdist workers) where the image lacks them. Logs and results go to $OUT (default
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
python -c "import expecttest" 2>/dev/null || for whl in .whl/expecttest-*.whl; do  # torch.library.opcheck needs it
  [ -e "$whl" ] && pip install -q --no-deps --target /tmp/site "$whl" && export PYTHONPATH=/tmp/site:${PYTHONPATH#/tmp/site:}
done
python -c "import xdist" 2>/dev/null || for whl in .whl/pytest_xdist-*.whl .whl/execnet-*.whl; do  # pyproject's -n auto
  [ -e "$whl" ] && pip install -q --no-deps --target /tmp/site "$whl" && export PYTHONPATH=/tmp/site:${PYTHONPATH#/tmp/site:}
done
if ! python -c "import mooncake.engine" 2>/dev/null; then  # PD: the non-cuda wheel and libibverbs1, no network needed
  for deb in .whl/libibverbs1_*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/ibverbs; done
  ib=$(ls -d /tmp/ibverbs/usr/lib/*-linux-gnu 2>/dev/null | head -n 1)
  [ -n "$ib" ] && export LD_LIBRARY_PATH=$ib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  for whl in .whl/mooncake_transfer_engine_non_cuda-*.whl; do
    [ -e "$whl" ] && pip install -q --no-deps --target /tmp/site "$whl" && export PYTHONPATH=/tmp/site:${PYTHONPATH#/tmp/site:}
  done
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python -c "import flash_mla; print('flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())";
  python -c "from dtkv.attention import available_backends; print(available_backends('cuda'))";
  python -c "from dtkv.transfer import mooncake_available; from dtkv.transfer.memory import mooncake_build, mooncake_registers_device_memory as d; print('mooncake', mooncake_available(), mooncake_build(), 'device memory', d())";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
: > "$OUT/steps.txt"
STEP_DIR=$OUT
. benchmarks/_steps.sh  # step NAME SECONDS CMD...: a deadline, $OUT/NAME.log, the exit status in steps.txt
phase=${1:-all}
case $phase in all|tests|bench|runtime|demo|pd|gpu) ;;
  *) echo "usage: gpu_flashmla.sh [all|tests|bench|runtime|demo|pd|gpu]"; exit 2;; esac
run() { [ "$phase" = all ] || [ "$phase" = "$1" ]; }
run tests && step cuda_tests 140 python -m pytest -q -rs -s -p no:cacheprovider tests/test_attention_cuda.py
run bench && step bench_flashmla 150 python benchmarks/bench_flashmla.py --out-dir "$OUT"
run runtime && step bench_runtime 160 python benchmarks/bench_runtime.py --attention flashmla --phases prefill,decode \
  --prefill 32768x8192 --decode-contexts 32768 --batches 1 --long-layers 0 --budget-s 140 --out-dir "$OUT"
run demo && step demo_reference 70 python -m dtkv.demo --cp 1 --device cuda --attention flashmla --kv-dtype fp8 \
  --tokens 1024 --json
run demo && step demo_deepseek 70 python -m dtkv.demo --cp 1 --device cuda --attention flashmla --model deepseek-v32 --json
# PD of CUDA pools: the decode group on the same GPU, the hand-off through pinned host memory (non-cuda Mooncake)
run pd && step pd_cuda 150 python -m dtkv.demo --device cuda --cp 1 --pd --model deepseek-v32 --attention flashmla \
  --decode sharded --timeout 120 --json
run pd && step pd_cuda_reference 150 python -m dtkv.demo --device cuda --cp 1 --pd --kv-dtype fp8 --timeout 120 --json
run pd && step bench_transfer 240 python benchmarks/bench_transfer.py --device cuda --reps 3 --out-dir "$OUT"
# the suite's GPU cases, one selection (target: <= 5 minutes on one H200); the slowest 30 in the log
run gpu && step gpu_suite 420 python -m pytest -m gpu -q -rs -p no:cacheprovider --durations=30

echo; echo "== summary ($OUT)"
cat "$OUT/steps.txt"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" 2>/dev/null | tail -n 2
grep -hE "^(flashmla vs|reference model,|deepseek-v32,|glm5,|FlashMLA, a query)" "$OUT/cuda_tests.log" 2>/dev/null | head -n 30
grep -h "TARGET" "$OUT"/flashmla_*.md "$OUT"/runtime_*.md 2>/dev/null
grep -hE "^\| (sparse_prefill|sparse_decode) " "$OUT"/flashmla_*.md 2>/dev/null
grep -h '"parity"' "$OUT"/demo_*.log "$OUT"/pd_*.log 2>/dev/null | cut -c1-300
grep -hE "through pinned host memory|in place, in rounds" "$OUT"/pd_cuda.log 2>/dev/null | head -n 4
grep -hE "^\| [0-9] -> [0-9] |^Raw Mooncake" "$OUT"/transfer_*.md 2>/dev/null
grep -E "passed|failed|error" "$OUT/gpu_suite.log" 2>/dev/null | tail -n 2
# exit status: every step green
! grep -v " rc=0 " "$OUT/steps.txt" | grep -q rc=
