#!/usr/bin/env bash
# Session 20 call 1: short prefill and mixed steps as decode-graph rows (new: main at 0a10e95, the change at 7198c25)
# against the tree before (base, 09ffc81): the graph GPU tests on new, then served
# against the engine at C = 1 and 64 per tree, in one call; then FP8 kill at EP2 with graphs.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
mkdir -p .ab/base && tar xzf .ab/base.tgz -C .ab/base && cat .ab/base/COMMIT
ELASTICEP_COMMIT=$C BUDGET=110 STEPS=gpu_tests PYTEST_X=-s GPU_S=105 \
  GPU_TESTS="tests/test_cuda_graph_gpu.py tests/test_peer_weights_gpu.py" bash bench/device_session.sh 2>&1 | tail -8
mv $OUT/gpu_tests.log $OUT/gpu_tests_graphs_$C.log
grep -h "graph vs eager" $OUT/gpu_tests_graphs_$C.log | head -5
echo "== tests done at $((SECONDS-T0))s"
RESERVE=115; (( TOTAL < 560 )) && RESERVE=0  # too little time: no FP8 kill
left=$((TOTAL - RESERVE - SECONDS + T0))
ELASTICEP_COMMIT=$C BUDGET=$left STEPS=sweep PPC=2 SWEEP_S=170 \
  SWEEPS="new@@1,64 base@tree=base@1,64" bash bench/device_session.sh 2>&1 | tail -12
grep -h "prefill warm-up\|pieces each" /tmp/sweep_logs_new/* 2>/dev/null | cut -c1-300 | head -4
echo "== sweeps done at $((SECONDS-T0))s"
# FP8 failover with graphs: the demo model quantized to block FP8, kill at EP2
PYTHONPATH=/tmp/site:$PWD:$PWD/tests python3 -c "
from pathlib import Path
from _fp8_ckpt import write_fp8_checkpoint
from elasticep_testkit.paths import DEMO_MODEL
write_fp8_checkpoint(DEMO_MODEL, Path('/tmp/fp8demo'), ('lm_head',))" && echo "fp8 checkpoint written"
left=$((TOTAL - SECONDS + T0))
ELASTICEP_COMMIT=$C BUDGET=$left STEPS=failover SCENARIOS="kill:0:2" FO_S=$((left - 5)) \
  FO_ARGS="--model /tmp/fp8demo" bash bench/device_session.sh 2>&1 | tail -3
[[ -f $OUT/failover.jsonl ]] && mv $OUT/failover.jsonl $OUT/failover_fp8.jsonl
echo "== done at $((SECONDS-T0))s"
