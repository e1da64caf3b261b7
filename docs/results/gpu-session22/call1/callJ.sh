#!/usr/bin/env bash
# Session 22 call 1 (main at HEAD_COMMIT): served against the engine, bf16, C = 64 and 256
# (the front-end's inline tokenization has not run on a GPU); the FP8 decode step's
# kernels at batch 1 and 64 (engine profiler, graphs on); the served FP8 rank's profile at
# C = 1 (the step the served TPOT ratio pays for); py-spy of the serve process
# (HTTP front-end) at C = 256.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
ELASTICEP_COMMIT=$C BUDGET=280 STEPS=sweep PPC=2 SWEEP_S=270 \
  SWEEPS="bf16@@64,256" bash bench/device_session.sh 2>&1 | tail -6
echo "== sweeps done at $((SECONDS-T0))s"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 110 python3 -m bench.scale --only profile --config bench/configs/qwen3-30b-a3b-fp8.json \
  --layers 48 --profile-batch 1,64 --profile-backends none --cuda-graph on --prompt-len 256 \
  --decode-tokens 64 --workdir /tmp/scalef > $OUT/fp8_engine_profile_$C.jsonl 2> /tmp/fep.err
tail -3 /tmp/fep.err | cut -c1-300
echo "== profile done at $((SECONDS-T0))s"
ELASTICEP_COMMIT=$C BUDGET=100 STEPS=served_profile Q3_CONFIG=qwen3-30b-a3b-fp8 PROFILE_C=1 \
  PROF_STEPS=40:10 SP_TRACE=1 bash bench/device_session.sh 2>&1 | tail -4
for f in $OUT/served_profile_c1_rank0*; do mv $f ${f/rank0/fp8_rank0_$C}; done
echo "== served profile done at $((SECONDS-T0))s"
left=$((TOTAL - SECONDS + T0 - 10))
(( left > 60 )) && ELASTICEP_COMMIT=$C BUDGET=$left STEPS=host_profile HP_WHO=frontend HP_CS=256 \
  HP_OUT=256 HP_T=$((left - 5)) HP_S=8 bash bench/device_session.sh 2>&1 | tail -4
ls -la $OUT
echo "== done at $((SECONDS-T0))s"
