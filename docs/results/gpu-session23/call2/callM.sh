#!/usr/bin/env bash
# Session 23 call B (main at HEAD_COMMIT): 1. every GPU test; 2. FP8 failover with graphs
# (the demo model as block FP8, ranks sharing the GPU): rejoin EP2, kill EP4, scale-up
# EP2 -> EP3; 3. if time is left, served FP8 against the FP8 engine at C = 1.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
left() { echo $((TOTAL - SECONDS + T0)); }
[[ -d /tmp/site ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ELASTICEP_COMMIT=$C
nvidia-smi --query-gpu=name --format=csv,noheader
ALL="$(ls tests/*_gpu.py | tr '\n' ' ') tests/test_gpu_data_plane.py"
BUDGET=285 STEPS=gpu_tests PYTEST_X=-q GPU_S=280 GPU_TESTS="$ALL" \
  bash bench/device_session.sh 2>&1 | grep -E "FAILED|ERROR|passed|failed|==" | tail -25
mv $OUT/gpu_tests.log $OUT/gpu_tests_all_$C.log
echo "== tests done at $((SECONDS-T0))s"
PYTHONPATH=/tmp/site:$PWD:$PWD/tests python3 -c "
from pathlib import Path
from _fp8_ckpt import write_fp8_checkpoint
from elasticep_testkit.paths import DEMO_MODEL
write_fp8_checkpoint(DEMO_MODEL, Path('/tmp/fp8demo'), ('lm_head',))" && echo "fp8 checkpoint written"
for sc in ${FO_SCENARIOS:-rejoin:0:2 kill:0:4 scale-up:0:2:3}; do
  l=$(left); (( l < 60 )) && { echo "SKIPPED $sc ($l s left)"; continue; }
  BUDGET=$l STEPS=failover SCENARIOS="$sc" FO_S=$((l > 100 ? 95 : l - 5)) \
    FO_ARGS="--model /tmp/fp8demo" bash bench/device_session.sh 2>&1 | tail -3
  [[ -f $OUT/failover.jsonl ]] && tail -1 $OUT/failover.jsonl | sed "s/^{/{\"weights\": \"fp8\", /" >> $OUT/failover_fp8_$C.jsonl
  rm -f $OUT/failover.jsonl
done
echo "== failover done at $((SECONDS-T0))s"
l=$(left)
if (( l > 110 )); then
  BUDGET=$((l - 5)) STEPS=sweep PPC=2 SWEEP_S=$((l - 10)) Q3_CONFIG=qwen3-30b-a3b-fp8 SWEEPS="fp8@@1" \
    bash bench/device_session.sh 2>&1 | tail -3
  [[ -f $OUT/sweep.jsonl ]] && mv $OUT/sweep.jsonl $OUT/sweep_fp8_c1_$C.jsonl
fi
rm -f $OUT/sweep_rank_lines.log
ls $OUT
echo "== done at $((SECONDS-T0))s"
