#!/usr/bin/env bash
# Session 19 call B: main (new) against h45k (main + the expert-kernel de-duplication)
set -u
OUT=${OUT:-/tmp/out}
T0=$SECONDS
rm -rf /tmp/k && mkdir -p /tmp/k && cp -r . /tmp/k/ && (cd /tmp/k && patch -s -p1 < .ab/h45k.patch) || echo "PATCH FAILED"
KT="tests/test_fp8_rows_gpu.py tests/test_fused_kernels_gpu.py tests/test_gpu_data_plane.py"
# 1. GPU tests: this tree (the new warm_kernels test, the FP8 demo test) and the k tree (kernels)
ELASTICEP_COMMIT=f107d60 BUDGET=100 STEPS=gpu_tests PYTEST_X= GPU_S=95 \
  GPU_TESTS="tests/test_ipc_exchange_gpu.py::test_warm_kernels_compile_every_send_form_a_step_takes tests/test_fp8_linear_gpu.py::test_fp8_demo_model_decodes_through_graphs_and_is_as_close_as_its_dequantized_copy" \
  bash bench/device_session.sh 2>&1 | tail -8
mv $OUT/gpu_tests.log $OUT/gpu_tests_new_f107d60.log
(cd /tmp/k && OUT=$OUT ELASTICEP_COMMIT=ba0c7c0 BUDGET=110 STEPS=gpu_tests PYTEST_X= GPU_S=105 GPU_TESTS="$KT" \
  bash bench/device_session.sh 2>&1 | tail -8)
mv $OUT/gpu_tests.log $OUT/gpu_tests_k_ba0c7c0.log
echo "== tests done at $((SECONDS-T0))s"
# 2. the per-row and sorted expert kernels, both trees, alternating
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for i in 1; do
  for t in new k; do
    d=$PWD; [[ $t == k ]] && d=/tmp/k
    c=f107d60; [[ $t == k ]] && c=ba0c7c0
    (cd $d && ELASTICEP_COMMIT=$c timeout 55 python3 -m bench.expert_gemv --sorted-rows 64,256,2048 \
      | sed "s/^{/{\"tree\": \"$t\", \"round\": $i, /" >> $OUT/expert_gemv.jsonl) 2>&1 | tail -2
  done
done
echo "== gemv done at $((SECONDS-T0))s"
# 3. served C=1,64 both trees
left=$((575 - SECONDS + T0))
ELASTICEP_COMMIT=f107d60 BUDGET=$((left/2)) STEPS=sweep PPC=2 SWEEPS="new@@1,64" SWEEP_S=$((left/2 - 5)) \
  bash bench/device_session.sh 2>&1 | tail -4
left=$((580 - SECONDS + T0))
(cd /tmp/k && OUT=$OUT ELASTICEP_COMMIT=ba0c7c0 BUDGET=$left STEPS=sweep PPC=2 SWEEPS="k@@1,64" SWEEP_S=$((left - 5)) \
  bash bench/device_session.sh 2>&1 | tail -4)
echo "== done at $((SECONDS-T0))s"
