#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}
B=$(cat .ab/H51B)
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && (cd /tmp/b && patch -s -p1 < .ab/h51b.patch) || echo "PATCH FAILED"
(cd /tmp/b && OUT=$OUT ELASTICEP_COMMIT=$B BUDGET=120 STEPS=gpu_tests PYTEST_X= GPU_S=115 \
  GPU_TESTS="tests/test_fp8_prefill_gpu.py" bash bench/device_session.sh 2>&1 | grep -v "^tests/.*PASSED" | tail -25)
mv $OUT/gpu_tests.log $OUT/gpu_tests_fp8_prefill_$B.log
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
(cd /tmp/b && ELASTICEP_COMMIT=$B timeout 120 python3 -m bench.fp8_linear --m 64,128,256,512,1024,8192 \
  > $OUT/fp8_linear_w8a8_$B.jsonl 2> /tmp/w8.err; tail -3 /tmp/w8.err | cut -c1-400)
python3 - "$OUT/fp8_linear_w8a8_$B.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d['shape'], d['m'], 'w8a8', d.get('w8a8_us'), d.get('w8a8_path'), 'x', d.get('w8a8_x_bound'),
          'wo', d.get('fp8_us'), 'bf16', d.get('bf16_us'), 'w/bf16', d.get('w8a8_over_bf16'), 'err', d.get('w8a8_rel_err_vs_reference'))
PY
