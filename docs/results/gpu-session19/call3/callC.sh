#!/usr/bin/env bash
# Session 19 call C: h51b (W8A8 prefill) on top of main: its GPU test, the dense bench,
# the decode-tile sweep, the FP8 served sweep; then DeepSeek-V3's FP8 decode shape.
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
B=$(cat .ab/H51B)
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && (cd /tmp/b && patch -s -p1 < .ab/h51b.patch) || echo "PATCH FAILED"
(cd /tmp/b && OUT=$OUT ELASTICEP_COMMIT=$B BUDGET=110 STEPS=gpu_tests PYTEST_X= GPU_S=105 \
  GPU_TESTS="tests/test_fp8_prefill_gpu.py" bash bench/device_session.sh 2>&1 | tail -25)
mv $OUT/gpu_tests.log $OUT/gpu_tests_fp8_prefill_$B.log
echo "== at $((SECONDS-T0))s"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
(cd /tmp/b && ELASTICEP_COMMIT=$B timeout 100 python3 -m bench.fp8_linear --m 256,1024,8192 \
  > $OUT/fp8_linear_w8a8_$B.jsonl 2> /tmp/w8.err; tail -3 /tmp/w8.err)
python3 - "$OUT/fp8_linear_w8a8_$B.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d['shape'], d['m'], 'w8a8', d.get('w8a8_us'), d.get('w8a8_path'), 'x', d.get('w8a8_x_bound'),
          'wo', d.get('fp8_us'), 'bf16', d.get('bf16_us'), 'err', d.get('w8a8_rel_err_vs_reference', d.get('fp8_rel_err_vs_reference')))
PY
echo "== at $((SECONDS-T0))s"
(cd /tmp/b && ELASTICEP_COMMIT=$B timeout 90 python3 -m bench.fp8_linear --m 16,64 --sweep \
  > $OUT/fp8_linear_sweep_$B.jsonl 2> /tmp/sw.err; tail -3 /tmp/sw.err)
python3 - "$OUT/fp8_linear_sweep_$B.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d['shape'], d['m'], 'tile', d.get('tile'), d.get('fp8_us'), 'best', d.get('best_tile'), d.get('best_us'), 'bf16', d.get('bf16_us'))
PY
echo "== at $((SECONDS-T0))s"
left=$((560 - SECONDS + T0 - 130))
(cd /tmp/b && OUT=$OUT ELASTICEP_COMMIT=$B BUDGET=$left STEPS=sweep PPC=2 Q3_CONFIG=qwen3-30b-a3b-fp8 \
  SWEEPS="fp8@@1,64" SWEEP_S=$((left - 5)) bash bench/device_session.sh 2>&1 | tail -4)
echo "== at $((SECONDS-T0))s"
left=$((575 - SECONDS + T0))
(cd /tmp/b && ELASTICEP_COMMIT=$B timeout $left python3 -m bench.scale --only hbm,ep1 \
  --config bench/configs/deepseek-v3-fp8.json --layers 6 --batches 1,64 --decode-tokens 16 \
  --cuda-graph on --workdir /tmp/dsv3 > $OUT/dsv3_fp8_decode_$B.jsonl 2> /tmp/ds.err; tail -5 /tmp/ds.err | cut -c1-400)
python3 - "$OUT/dsv3_fp8_decode_$B.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get('section') == 'ep1': print(d.get('batch'), d.get('decode_step_ms'), 'x bound', d.get('x_hbm_bound'), d.get('error', '')[:300])
PY
echo "== done at $((SECONDS-T0))s"
