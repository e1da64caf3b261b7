#!/usr/bin/env bash
# Session 21 call 1 (main at HEAD_COMMIT): every GPU test; rank 0's profile of served
# prefill steps at C = 64 with the chrome trace; FP8 failover with graphs at EP2/EP4
# (rejoin, scale-up EP2 -> EP3, kill at EP4), the demo model quantized to block FP8.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
ALL="$(ls tests/*_gpu.py | tr '\n' ' ') tests/test_gpu_data_plane.py"
ELASTICEP_COMMIT=$C BUDGET=275 STEPS=gpu_tests PYTEST_X=-s GPU_S=270 GPU_TESTS="$ALL" \
  bash bench/device_session.sh 2>&1 | grep -E "FAILED|ERROR|passed|failed|==" | tail -25
mv $OUT/gpu_tests.log $OUT/gpu_tests_$C.log
grep -h "graph vs eager" $OUT/gpu_tests_$C.log | head -6
echo "== tests done at $((SECONDS-T0))s"
ELASTICEP_COMMIT=$C BUDGET=100 STEPS=served_profile PROFILE_C=64 PROF_STEPS=4:3 SP_TRACE=1 \
  bash bench/device_session.sh 2>&1 | tail -8
echo "== profile done at $((SECONDS-T0))s"
timeout 90 python3 -m bench.fp8_expert_prefill --tokens 2048,8192 > $OUT/fp8_expert_prefill_$C.jsonl 2> /tmp/fep.err
tail -3 /tmp/fep.err | cut -c1-300; cut -c1-400 $OUT/fp8_expert_prefill_$C.jsonl
echo "== fp8 expert prefill bench done at $((SECONDS-T0))s"
PYTHONPATH=/tmp/site:$PWD:$PWD/tests python3 -c "
from pathlib import Path
from _fp8_ckpt import write_fp8_checkpoint
from elasticep_testkit.paths import DEMO_MODEL
write_fp8_checkpoint(DEMO_MODEL, Path('/tmp/fp8demo'), ('lm_head',))" && echo "fp8 checkpoint written"
for sc in rejoin:0:2 kill:0:4 scale-up:0:2:3; do
  left=$((TOTAL - SECONDS + T0))
  (( left < 60 )) && { echo "SKIPPED $sc ($left s left)"; continue; }
  ELASTICEP_COMMIT=$C BUDGET=$left STEPS=failover SCENARIOS="$sc" FO_S=$((left > 110 ? 105 : left - 5)) \
    FO_ARGS="--model /tmp/fp8demo" bash bench/device_session.sh 2>&1 | tail -4
  [[ -f $OUT/failover.jsonl ]] && tail -1 $OUT/failover.jsonl | sed "s/^{/{\"weights\": \"fp8\", /" >> $OUT/failover_fp8_$C.jsonl
  rm -f $OUT/failover.jsonl
done
echo "== done at $((SECONDS-T0))s"
