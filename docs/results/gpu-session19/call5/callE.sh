#!/usr/bin/env bash
# Session 19 final call: every GPU test at HEAD, the FP8 served sweep (W8A8 prefill on),
# and the kill scenario with graphs (no survivor re-captures).
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
C=$(cat .ab/HEAD_COMMIT)
ALL="$(ls tests/*_gpu.py | tr '\n' ' ') tests/test_gpu_data_plane.py"
ELASTICEP_COMMIT=$C BUDGET=300 STEPS=gpu_tests PYTEST_X= GPU_S=295 GPU_TESTS="$ALL" \
  bash bench/device_session.sh 2>&1 | grep -E "FAILED|ERROR|passed|failed|==" | tail -25
mv $OUT/gpu_tests.log $OUT/gpu_tests_$C.log
grep -h "differ, by at most" $OUT/gpu_tests_$C.log | head -5
echo "== tests done at $((SECONDS-T0))s"
left=$((575 - SECONDS + T0 - 100))
ELASTICEP_COMMIT=$C BUDGET=$left STEPS=sweep PPC=2 Q3_CONFIG=qwen3-30b-a3b-fp8 \
  SWEEPS="fp8@@1,64" SWEEP_S=$((left - 5)) bash bench/device_session.sh 2>&1 | tail -4
mv $OUT/sweep.jsonl $OUT/sweep_fp8_$C.jsonl
echo "== sweep done at $((SECONDS-T0))s"
left=$((580 - SECONDS + T0))
ELASTICEP_COMMIT=$C BUDGET=$left STEPS=failover SCENARIOS="kill:0:2" FO_S=$((left - 5)) \
  bash bench/device_session.sh 2>&1 | tail -6
echo "== done at $((SECONDS-T0))s"
