# Sourced by the GPU run scripts (gpu_decode.sh, gpu_flashmla.sh, h200x2.sh, scripts/gpu_*.sh), after they set
# STEP_DIR:
#   step NAME SECONDS CMD...   run CMD with a deadline, log to $STEP_DIR/NAME.log, record the exit status and the
#                              time taken in $STEP_DIR/steps.txt (and print that line)
step() {
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$STEP_DIR/$name.log" 2>&1
  echo "$name rc=$? ${secs}s-limit took=$(( $(date +%s) - t0 ))s" | tee -a "$STEP_DIR/steps.txt"
}
