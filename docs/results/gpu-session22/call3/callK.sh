#!/usr/bin/env bash
# Session 22 final call (main at HEAD_COMMIT; base = c67e869 for the decode A/B), in
# priority order: 1. the GPU tests of the expert kernels changed since c67e869 (the slot
# sort, the tile lookup) at the default tiles; 2. served against the engine with
# --api-server-count 4 at C = 256 (bf16); 3. the FP8 decode tile sweep on Qwen3-30B-A3B's
# experts, its table written into the package, then the tile GPU tests again with it;
# 4. the FP8 decode step, base tree then this tree, batches 1 and 64.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
TOTAL=${TOTAL:-585}
C=$(cat .ab/HEAD_COMMIT)
left() { echo $((TOTAL - SECONDS + T0)); }
mkdir -p .ab/base && tar xzf .ab/base_c67e869.tgz -C .ab/base && cat .ab/base/COMMIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ELASTICEP_COMMIT=$C
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_decode_tiles_gpu.py \
  tests/test_fp8_rows_gpu.py tests/test_fused_kernels_gpu.py tests/test_fp8_expert_prefill_gpu.py \
  > $OUT/gpu_tests_kernels_$C.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_kernels_$C.log
echo "== tests done at $((SECONDS-T0))s"
l=$(left); (( l > 150 )) && BUDGET=155 STEPS=sweep PPC=2 SWEEP_S=150 \
  SWEEP_EXTRA="--serve-arg=--api-server-count --serve-arg=4" SWEEPS="api4@@256" \
  bash bench/device_session.sh 2>&1 | tail -3
echo "== served done at $((SECONDS-T0))s"
l=$(left)
if (( l > 100 )); then
  timeout $((l - 45)) python3 -m bench.fp8_decode_sweep --max-seconds $((l - 95)) \
    --shape 2048x768:128 --rows 1,8,64 --sorted-rows 128,512,2048 --write-table $OUT \
    --write-table elasticep/moe/experts/tile_configs > $OUT/fp8_decode_sweep_$C.jsonl \
    2> $OUT/fp8_decode_sweep_$C.err; echo "sweep rc=$?"
  tail -n 1 $OUT/fp8_decode_sweep_$C.jsonl | cut -c1-2500; ls elasticep/moe/experts/tile_configs/
  echo "== sweep done at $((SECONDS-T0))s"
  timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_decode_tiles_gpu.py \
    tests/test_fp8_rows_gpu.py > $OUT/gpu_tests_table_$C.log 2>&1; echo "table tests rc=$?"
  tail -2 $OUT/gpu_tests_table_$C.log
fi
for tree in base new; do
  l=$(left); (( l < 75 )) && { echo "SKIPPED decode_$tree ($l s left)"; continue; }
  if [[ $tree == base ]]; then pp=/tmp/site:$PWD/.ab/base:$PWD; cc=c67e869; else pp=/tmp/site:$PWD; cc=$C; fi
  PYTHONSAFEPATH=1 PYTHONPATH=$pp ELASTICEP_COMMIT=$cc timeout $((l - 8)) python3 -m bench.scale \
    --only hbm,ep1 --config bench/configs/qwen3-30b-a3b-fp8.json --layers 48 --batches 1,64 \
    --decode-tokens 32 --cuda-graph on --workdir /tmp/scale_$tree \
    | sed "s/^{/{\"tree\": \"$tree\", /" >> $OUT/fp8_decode_ab.jsonl 2> /tmp/dec_$tree.err
  tail -1 /tmp/dec_$tree.err | cut -c1-200
  grep '"ep1"' $OUT/fp8_decode_ab.jsonl | cut -c1-400 | tail -2
done
echo "== done at $((SECONDS-T0))s"
