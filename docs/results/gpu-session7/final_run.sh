#!/usr/bin/env bash
# Session 7's last device call (one H200), in priority order within the 600 s a call may
# run: GPU tests, the served sweep against the engine, failover with graphs on (rejoin),
# the exchange microbench, and served TTFT of 2048-token prompts. Each step gets what is
# left of the call's time; a step that cannot start in time is skipped and says so.
# Run from the repository root with the serve wheels carried in .whl/ and
# ELASTICEP_COMMIT set; results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-585}
left() { echo $((BUDGET - SECONDS)); }
step() {  # step NAME SECONDS_WANTED COMMAND...
    local name=$1 want=$2; shift 2
    local t=$(left)
    if [ "$t" -lt 20 ]; then echo "SKIPPED $name ($t s left)" >&2; return; fi
    [ "$want" -lt "$t" ] && t=$want
    echo "== $name (limit $t s, at ${SECONDS}s)" >&2
    timeout "$t" "$@"
    echo "== $name rc=$? at ${SECONDS}s" >&2
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/q3 && cp bench/configs/qwen3-30b-a3b.json /tmp/q3/config.json \
    && cp models/tiny-qwen3-moe/tokenizer* /tmp/q3/

step gpu_tests ${GPU_S:-210} python3 -m pytest -v -p no:cacheprovider ${GPU_TESTS:-tests/test_ipc_exchange_gpu.py} \
    > "$OUT/gpu_tests.log" 2>&1
tail -25 "$OUT/gpu_tests.log"
if grep -Eq "(fused_static_dispatch|one_graph_and_equals).*FAILED|FAILED.*(fused_static_dispatch|one_graph_and_equals)" "$OUT/gpu_tests.log"; then
    echo "fused dispatch failed its test: the runs below use the three-kernel path"
    export ELASTICEP_FUSED_DISPATCH=0
fi

Q3="--device cuda --model /tmp/q3 --load-format dummy --dtype bfloat16 --ignore-eos"
step sweep ${SWEEP_S:-200} python3 -m bench.serving_sweep --concurrencies 1,64 --prompts-per-concurrency 2 \
    $Q3 --random-input-len 256 --random-output-len 256 --random-range-ratio 1 \
    --serve-arg=--max-ep-size --serve-arg=2 --log-dir /tmp/sweep_logs \
    > "$OUT/sweep.jsonl" 2> /tmp/sweep.err
tail -3 /tmp/sweep.err
grep -h "MoE transport\|peer waits\|pieces each\|steps in\|warm-up\|warmup" /tmp/sweep_logs/* 2>/dev/null \
    | cut -c1-260 | tail -12 > "$OUT/sweep_rank_lines.log"
cat "$OUT/sweep_rank_lines.log"

step rejoin 110 python3 -m bench.failover --scenario rejoin --ep-size 2 --victim 1 --device cuda \
    --healthy-s 4 --degraded-s 5 --after-s 5 --log-dir /tmp/fo_rejoin >> "$OUT/failover.jsonl" \
    2> /tmp/fo.err
tail -3 /tmp/fo.err
step kill_r0 80 python3 -m bench.failover --scenario kill --ep-size 2 --victim 1 --device cuda \
    --ep-num-redundant-experts 0 --healthy-s 4 --degraded-s 5 --after-s 5 \
    --log-dir /tmp/fo_kill_r0 >> "$OUT/failover.jsonl" 2>> /tmp/fo.err
cut -c1-700 "$OUT/failover.jsonl"
grep -h "abandon\|releasing\|mapped the\|pieces each\|Traceback\|Error" /tmp/fo_*/* 2>/dev/null \
    | cut -c1-220 | tail -20 > "$OUT/failover_lines.log"

for w in 2 4; do
    step "ipc_exchange_ep$w" 45 python3 -m bench.ipc_exchange --world $w --tokens 1,16,128 \
        >> "$OUT/ipc_exchange.jsonl" 2>> /tmp/ipc.err
done
tail -3 /tmp/ipc.err
step ttft_2048 70 python3 -m bench.serving --launch $Q3 --random-input-len 2048 \
    --random-output-len 8 --random-range-ratio 1 --max-concurrency 1 --num-prompts 6 \
    --serve-arg=--max-ep-size --serve-arg=2 > "$OUT/ttft_2048.jsonl" 2> /tmp/ttft.err
tail -2 /tmp/ttft.err
echo "done at ${SECONDS}s"
