#!/usr/bin/env bash
# The GPU measurements of benchmarks/results/*_h200x2_*: run from the repository root on a host with 2 GPUs on NVLink.
#   bash benchmarks/h200x2.sh views     # bench_materialize --check, its sweep, the runtime's CP prefill (bench_runtime)
#   bash benchmarks/h200x2.sh narrow    # the runtime's CP decode (bench_runtime) and the 128K overlap (more samples)
#   bash benchmarks/h200x2.sh demo      # python -m dtkv.demo on NCCL (reference and transformers models)
#   bash benchmarks/h200x2.sh rest      # bench_decode, the transformers parity grid on NCCL, the CUDA tests and bench_ops
# Logs and results go to $OUT (default benchmarks/results/run-<date>) and, packed, to $OUT/h200x2_<phase>.tar.gz.
set -uo pipefail
phase=${1:?usage: h200x2.sh views|narrow|rest|hf|demo|tests}
OUT=${OUT:-benchmarks/results/run-$(date +%F)}
mkdir -p "$OUT/$phase"
R="$OUT/$phase"
[ -e dtkv/ops ] || ln -sfn ../ops dtkv/ops   # a checkout without the editable install (see pyproject's package-dir)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  git log -1 --format='commit %H %s' 2>/dev/null; } > "$R/env.txt" 2>&1
step() {  # step NAME SECONDS CMD...: run with a deadline, log to $R/NAME.log, record the exit status
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? ${secs}s-limit took=$(( $(date +%s) - t0 ))s" | tee -a "$R/steps.txt"
}
TR="torchrun --nproc-per-node 2"
cuda_tests() {  # cuda_tests GPU SECONDS: the suite's CUDA cases (expecttest comes as a wheel in .whl/: no network there)
  [ -d /tmp/whl ] || python -m zipfile -e .whl/expecttest-0.3.0-py3-none-any.whl /tmp/whl
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$PYTHONPATH:/tmp/whl timeout "$2" python -m pytest -q -p no:cacheprovider \
    tests/test_ops_*.py tests/test_model.py tests/test_split.py tests/test_materialize_copy_engine.py -k cuda > "$R/cuda_tests.log" 2>&1
}
case $phase in
  views)
    step mat_check 120 $TR benchmarks/bench_materialize.py --check
    step mat 190 env OUT="$R" $TR benchmarks/bench_materialize.py --tokens 32768 131072 262144 1048576 --layers 1 8 --reps 5 --overlap-reps 5
    # the runtime's CP prefill, replicated vs sharded KV with compute-owner writes (64K-256K, transformers model)
    step runtime_prefill 250 env OUT="$R" $TR benchmarks/bench_runtime.py --phases prefill --adapters transformers \
      --kv-modes replicated,sharded_direct --prefill 65536x8192,131072x8192,262144x8192 --budget-s 230
    ;;
  narrow)  # the runtime's CP decode; the 128K overlap with more samples
    # the runtime's CP decode, full view vs sharded, both adapters (32K / 128K x batch 1 / 16)
    step runtime_decode 300 env OUT="$R" $TR benchmarks/bench_runtime.py --phases decode --long-layers 0 --budget-s 280
    step mat_overlap 200 env OUT="$R" $TR benchmarks/bench_materialize.py --tokens 131072 --layers 8 --reps 10 --overlap-reps 40
    ;;
  rest)
    step decode 150 $TR benchmarks/bench_decode.py --out-dir "$R"
    # correctness runs beside each other (the timed ones run alone, or on a GPU of their own)
    cuda_tests 0 330 &
    tests=$!
    step hf_parity 170 $TR benchmarks/bench_hf_parity.py --device cuda --dtypes bfloat16,float32 --page-sizes 64 --out "$R"
    step ops_bench 150 env CUDA_VISIBLE_DEVICES=1 python benchmarks/bench_ops.py --out "$R/ops_h200_$(date +%F).md"
    wait $tests; echo "cuda_tests rc=$?" | tee -a "$R/steps.txt"
    ;;
  hf)
    step hf_parity 170 $TR benchmarks/bench_hf_parity.py --device cuda --dtypes bfloat16,float32 --page-sizes 64 --out "$R"
    ;;
  demo)  # the demo on NCCL: reference model (full and sharded decode, multi-turn prefix cache), transformers models
    step demo_ref 120 $TR -m dtkv.demo --json --device cuda
    step demo_sharded_decode 120 $TR -m dtkv.demo --json --device cuda --decode sharded --kv-dtype fp8
    step demo_multi_turn 150 $TR -m dtkv.demo --json --device cuda --multi-turn
    step demo_glm5 120 $TR -m dtkv.demo --json --device cuda --model glm5 --dtype bfloat16
    step demo_deepseek 120 $TR -m dtkv.demo --json --device cuda --model deepseek-v32 --kv-dtype fp8
    ;;
  tests)
    cuda_tests 0 330; echo "cuda_tests rc=$?" | tee -a "$R/steps.txt"
    ;;
esac
tar -C "$OUT" -czf "$OUT/h200x2_$phase.tar.gz" "$phase"
ls -la "$R"
