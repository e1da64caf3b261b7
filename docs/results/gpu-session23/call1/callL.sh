#!/usr/bin/env bash
# Session 23 call A (main at HEAD_COMMIT), in priority order: 1. the W8A8 prefill tile
# sweep (both expert shapes, 2048 and 8192 tokens), its table merged into the package;
# 2. the W8A8 and tile GPU tests with that table; 3. the whole FP8 prefill step (48 layers)
# against its FP8 bound; 4. the FP8 and bf16 decode steps in the same run.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
R=/tmp/res; mkdir -p $R
left() { echo $((TOTAL - SECONDS + T0)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ELASTICEP_COMMIT=$C
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 260 python3 -m bench.fp8_expert_prefill --tokens 2048,8192 --sweep \
  --write-table elasticep/moe/experts/tile_configs > $OUT/fp8_prefill_sweep_$C.jsonl 2> $R/sweep.err
echo "sweep rc=$?"; tail -3 $R/sweep.err | cut -c1-300
grep '"bench": "fp8_expert_prefill"' $OUT/fp8_prefill_sweep_$C.jsonl | cut -c1-700
tail -1 $OUT/fp8_prefill_sweep_$C.jsonl | cut -c1-1500
cp elasticep/moe/experts/tile_configs/*.json $OUT/
echo "== sweep done at $((SECONDS-T0))s"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_expert_prefill_gpu.py \
  tests/test_fp8_tiles_gpu.py > $R/gpu_tests_w8a8.log 2>&1; echo "w8a8 tests rc=$?"
tail -3 $R/gpu_tests_w8a8.log
echo "== tests done at $((SECONDS-T0))s"
l=$(left)
if (( l > 150 )); then
  timeout $((l > 260 ? 130 : l - 120)) python3 -m bench.scale --only prefill \
    --config bench/configs/qwen3-30b-a3b-fp8.json --layers 48 --prefill-lens 8192 \
    --prefill-budgets 8192 --prefill-repeats 3 --workdir /tmp/scale_pf \
    > $OUT/fp8_prefill_step_$C.jsonl 2> $R/prefill.err; echo "prefill rc=$?"
  tail -2 $R/prefill.err | cut -c1-300; cut -c1-600 $OUT/fp8_prefill_step_$C.jsonl | head -8
fi
echo "== prefill done at $((SECONDS-T0))s"
for cfg in qwen3-30b-a3b-fp8 qwen3-30b-a3b; do
  l=$(left); (( l < 70 )) && { echo "SKIPPED decode $cfg ($l s left)"; continue; }
  timeout $((l - 8)) python3 -m bench.scale --only hbm,ep1 --config bench/configs/$cfg.json \
    --layers 48 --batches 1,16,64,256 --decode-tokens 32 --cuda-graph on --workdir /tmp/scale_$cfg \
    | sed "s/^{/{\"config\": \"$cfg\", /" >> $OUT/decode_fp8_bf16_$C.jsonl 2> $R/dec_$cfg.err
  tail -1 $R/dec_$cfg.err | cut -c1-200
  grep '"ep1"' $OUT/decode_fp8_bf16_$C.jsonl | cut -c1-500 | tail -4
done
tar czf $OUT/logs_$C.tgz -C /tmp res
echo "== done at $((SECONDS-T0))s"
