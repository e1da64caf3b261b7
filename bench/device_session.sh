#!/usr/bin/env bash
# The device calls of a session (one H200), in priority order within the 600 s a call may run.
# Each step gets what is left of the call's time; a step that cannot start in time is
# skipped and says so. Run from the repository root with the serve wheels carried in
# .whl/ and ELASTICEP_COMMIT set; results go to $OUT. STEPS picks the steps (names below).
set -u
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-585}
STEPS=${STEPS:-gpu_tests,engine_profile,served_profile,sweep,failover}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
# PYTHONPATH that runs tree NAME: "new" is this tree, any other the package of .ab/NAME
# (carried). Use with PYTHONSAFEPATH=1, or `python -m` puts this tree first anyway.
tree_path() { if [[ $1 == new ]]; then echo "/tmp/site:$PWD"; else echo "/tmp/site:$PWD/.ab/$1:$PWD"; fi; }
# The commit tree NAME was cut from, for its records' "commit" (the bench scripts read
# $ELASTICEP_COMMIT; a base tree's lines must not carry this tree's commit): "new" is
# $ELASTICEP_COMMIT, any other the first line of .ab/NAME/COMMIT (written beside the
# carried package: `git rev-parse --short REV > .ab/NAME/COMMIT`). Fails without one.
tree_commit() {
    if [[ $1 == new ]]; then echo "${ELASTICEP_COMMIT:?set ELASTICEP_COMMIT}"
    elif [[ -s .ab/$1/COMMIT ]]; then head -1 ".ab/$1/COMMIT"
    else echo "no .ab/$1/COMMIT: the records of tree $1 would carry no commit" >&2; return 1; fi
}
step() {  # step NAME SECONDS_WANTED COMMAND...: at most what is left of BUDGET
    local name=$1 limit=$((BUDGET - SECONDS))
    (( $2 < limit )) && limit=$2
    shift 2
    if (( limit < 20 )); then echo "SKIPPED $name ($((BUDGET - SECONDS)) s left)" >&2; return; fi
    echo "== $name (limit $limit s, at ${SECONDS}s)" >&2
    timeout "$limit" "$@"
    echo "== $name rc=$? at ${SECONDS}s" >&2
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
rm -rf /tmp/q3 && mkdir -p /tmp/q3 && cp bench/configs/${Q3_CONFIG:-qwen3-30b-a3b}.json /tmp/q3/config.json \
    && cp models/tiny-qwen3-moe/tokenizer* /tmp/q3/
Q3="--device cuda --model /tmp/q3 --load-format dummy --dtype bfloat16 --ignore-eos"

if want gpu_tests; then
    step gpu_tests ${GPU_S:-150} python3 -m pytest -v -p no:cacheprovider ${PYTEST_X--x} \
        ${GPU_TESTS:-tests/test_ipc_exchange_gpu.py tests/test_cuda_graph_ep_gpu.py} \
        > "$OUT/gpu_tests.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -30
fi

if want engine_profile; then
    step engine_profile 90 python3 -m bench.scale --only profile --profile-batch ${PROFILE_B:-1,64} \
        --cuda-graph on --prompt-len 256 --decode-tokens 64 --workdir /tmp/scale \
        > "$OUT/engine_profile.jsonl" 2> /tmp/engine_profile.err
    tail -3 /tmp/engine_profile.err
fi

if want served_profile; then
    for c in ${PROFILE_C:-64 1}; do
        n=$((c > 1 ? 2 * c : 2))
        rm -rf /tmp/prof$c
        ELASTICEP_TORCH_PROFILER_DIR=/tmp/prof$c ELASTICEP_TORCH_PROFILER_STEPS=${PROF_STEPS:-200:10} \
        step "served_profile_c$c" 90 python3 -m bench.serving --launch $Q3 --random-input-len 256 \
            --random-output-len 256 --random-range-ratio 1 --max-concurrency $c --num-prompts $n \
            --serve-arg=--max-ep-size --serve-arg=2 --serve-arg=--log-stats-interval --serve-arg=1 \
            ${SP_EXTRA:---serve-arg=--max-total-tokens --serve-arg=131296} \
            --log-dir /tmp/servelog$c >> "$OUT/served_profile.jsonl" 2> /tmp/sp$c.err
        tail -2 /tmp/sp$c.err
        cp /tmp/prof$c/rank0.json "$OUT/served_profile_c${c}_rank0.json" 2>/dev/null \
            || echo "no profile for c=$c"
        # the chrome trace too (SP_TRACE=1): the summary names a gap, the trace's host
        # events say what the host did in it
        [[ ${SP_TRACE:-0} == 1 ]] && gzip -c /tmp/prof$c/rank0.trace.json \
            > "$OUT/served_profile_c${c}_rank0.trace.json.gz" 2>/dev/null
        grep -h "steps in\|pieces each" /tmp/servelog$c/* 2>/dev/null | cut -c1-250 | tail -6
    done
fi

if want host_profile; then  # where a served rank's host time goes: py-spy of rank 0
    for c in ${HP_CS:-1 64}; do
        rm -rf /tmp/hplog$c
        timeout ${HP_T:-120} python3 -m bench.serving --launch $Q3 --random-input-len 256 \
            --random-output-len ${HP_OUT:-1536} --random-range-ratio 1 --max-concurrency $c \
            --num-prompts $((2 * c)) --serve-arg=--max-ep-size --serve-arg=2 \
            --serve-arg=--log-stats-interval --serve-arg=1 --log-dir /tmp/hplog$c \
            >> "$OUT/host_profile_serving.jsonl" 2> /tmp/hp$c.err &
        bench_pid=$!
        for _ in $(seq 1 100); do  # until the rank decodes
            grep -q "decode CUDA graph replays" /tmp/hplog$c/rank0.log 2>/dev/null && break
            sleep 1
        done
        sleep 4
        # HP_WHO=frontend: the serve process (HTTP front-end, tokenizer, detokenizer)
        if [[ ${HP_WHO:-rank} == frontend ]]; then
            worker=$(pgrep -f "elasticep.entrypoints.cli serve" | head -1)
        else
            worker=$(pgrep -f "elasticep.elastic.worker" | head -1)
        fi
        echo "== host_profile_c$c (${HP_WHO:-rank} $worker, at ${SECONDS}s)" >&2
        # HP_NB=0: py-spy pauses the rank at each sample (slower, but whole stacks; a
        # non-blocking sample can tear a stack between frames)
        timeout 40 /tmp/site/bin/py-spy record -p "$worker" -d ${HP_S:-8} -r ${HP_RATE:-1000} \
            --idle --threads -f raw -o "$OUT/host_profile_${HP_WHO:-rank}_c$c.txt" \
            $([[ ${HP_NB:-1} == 1 ]] && echo --nonblocking) 2>&1 | tail -1
        grep -h "ms/step in" /tmp/hplog$c/rank0.log | cut -c1-400 | tail -6 \
            >> "$OUT/host_profile_lines.log"
        wait $bench_pid
        tail -1 /tmp/hp$c.err | cut -c1-200
    done
fi

if want sweep; then  # served against the engine; SWEEPS: label@VAR=value@concurrencies ...
    for spec in ${SWEEPS:-default@@1,64}; do
        IFS=@ read -r label assign cs <<< "$spec"
        # tree=NAME: the package of .ab/NAME in place of this tree's (tree_path)
        if [[ $assign == tree=* ]]; then
            c=$(tree_commit "${assign#tree=}") || { echo "SKIPPED sweep_$label" >&2; continue; }
            assign="PYTHONSAFEPATH=1 PYTHONPATH=$(tree_path "${assign#tree=}") ELASTICEP_COMMIT=$c"
        fi
        step "sweep_$label" ${SWEEP_S:-150} env $assign \
            python3 -m bench.serving_sweep --concurrencies $cs \
            --prompts-per-concurrency ${PPC:-2} $Q3 --random-input-len 256 --random-output-len 256 \
            --random-range-ratio 1 --serve-arg=--max-ep-size --serve-arg=2 ${SWEEP_EXTRA:-} \
            --log-dir /tmp/sweep_logs_$label | sed "s/^{/{\"label\": \"$label\", /" \
            >> "$OUT/sweep.jsonl" 2> /tmp/sweep_$label.err
        tail -2 /tmp/sweep_$label.err | cut -c1-300
        grep -h "pieces each\|steps in\|limits:\|scope\|replaying\|forms" /tmp/sweep_logs_$label/* 2>/dev/null \
            | cut -c1-700 | tail -${SWEEP_LINES:-12} | sed "s/^/$label /" >> "$OUT/sweep_rank_lines.log"
    done
    python3 -c "
import json
for l in open('$OUT/sweep.jsonl'):
    d=json.loads(l); e=d['engine']
    print(d['label'], d['max_concurrency'], 'tpot', d['median_tpot_ms'], e['median_tpot_ms'], 'itl', d['median_itl_ms'], e['median_itl_ms'], d['served_over_engine'])"
fi

if want fp8_kernels; then  # the FP8 expert and dense kernels against their reference, then timed
    step fp8_tests ${FP8T_S:-150} python3 -m pytest -v -p no:cacheprovider \
        tests/test_fp8_rows_gpu.py tests/test_fp8_linear_gpu.py > "$OUT/fp8_tests.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/fp8_tests.log" | tail -12
    step fp8_experts ${FP8E_S:-90} python3 -m bench.fp8_experts --rows 1,8,64 \
        > "$OUT/fp8_experts.jsonl" 2> /tmp/fp8e.err
    tail -2 /tmp/fp8e.err | cut -c1-300
    python3 -c "
import json
for l in open('$OUT/fp8_experts.jsonl'):
    d=json.loads(l); print(d['hidden'], d['rows'], 'fp8', d['fp8_us'], 'bf16', d['bf16_us'], d['fp8_over_bf16'], 'x bound', d['fp8_x_bound'], d['bf16_x_bound'], 'err', d['fp8_rel_err_vs_reference'])"
    step fp8_linear ${FP8L_S:-120} python3 -m bench.fp8_linear --m ${FP8L_M:-1,16,64,8192} \
        > "$OUT/fp8_linear.jsonl" 2> /tmp/fp8l.err
    tail -2 /tmp/fp8l.err | cut -c1-300
    python3 -c "
import json
for l in open('$OUT/fp8_linear.jsonl'):
    d=json.loads(l); print(d['shape'], d['m'], 'fp8', d['fp8_us'], 'bf16', d['bf16_us'], d['fp8_over_bf16'], 'x bound', d['fp8_x_bound'], d['bf16_x_bound'], 'err', d['fp8_rel_err_vs_reference'])"
fi

if want fp8_decode; then  # the decode step in FP8 and bf16 on one shape, one run each
    mkdir -p /tmp/q3f && cp bench/configs/${FP8_CONFIG:-qwen3-30b-a3b-fp8}.json /tmp/q3f/config.json
    for cfg in ${FP8_CONFIGS:-qwen3-30b-a3b-fp8 qwen3-30b-a3b}; do
        step "decode_$cfg" ${FP8D_S:-150} python3 -m bench.scale --only hbm,ep1 \
            --config bench/configs/$cfg.json --layers ${FP8_LAYERS:-48} \
            --batches ${FP8_BATCHES:-1,16,64,256} --decode-tokens ${FP8_TOKENS:-32} --cuda-graph on \
            --workdir /tmp/scale_$cfg > /tmp/fp8d_$cfg.jsonl 2> /tmp/fp8d_$cfg.err
        sed "s/^{/{\"model_config\": \"$cfg\", /" /tmp/fp8d_$cfg.jsonl >> "$OUT/fp8_decode.jsonl"
        tail -2 /tmp/fp8d_$cfg.err | cut -c1-300
    done
    python3 -c "
import json
for l in open('$OUT/fp8_decode.jsonl'):
    d=json.loads(l)
    if d.get('section') == 'ep1': print(d['model_config'], d.get('batch'), d.get('decode_step_ms'), 'x bound', d.get('x_hbm_bound'), d.get('error', '')[:300])"
fi

if want exchange; then  # memop node cost in a graph, then the exchange per layer
    step graph_node_cost 60 python3 -m bench.graph_node_cost --layers 48 \
        >> "$OUT/exchange.jsonl" 2> /tmp/gnc.err
    tail -2 /tmp/gnc.err | cut -c1-300
    # EXCHANGES: ';'-separated "world max_ep_size [flags]" specs
    IFS=';' read -ra specs <<< "${EXCHANGES:-1 2 --static;2 2 --static;4 4 --static}"
    for spec in "${specs[@]}"; do
        read -r world g rest <<< "$spec"
        step "exchange_w${world}_g$g" ${EX_S:-60} python3 -m bench.ipc_exchange --world $world \
            --max-ep-size $g --tokens ${EX_TOKENS:-1,16,128} $rest >> "$OUT/exchange.jsonl" 2> /tmp/ex.err
        tail -2 /tmp/ex.err | cut -c1-300
    done
    python3 -c "
import json
for l in open('$OUT/exchange.jsonl'):
    d=json.loads(l)
    if d['bench'] == 'graph_node_cost': print(d); continue
    print(d['world'], d['max_ep_size'], d['static'], d['block_h'], d['num_warps'], [(r['tokens_per_rank'], r['layer_us'], r['roundtrip_equal']) for r in d['ranks'][0].get('rows', [])], d['ranks'][0].get('error', '')[:300])"
fi

if want expert_forms; then  # the exchange's decode stages against the engine's
    for tree in ${EF_TREES:-new}; do  # new: this tree; else .ab/NAME's package (carried)
        c=$(tree_commit "$tree") || { echo "SKIPPED expert_forms_$tree" >&2; continue; }
        step "expert_forms_$tree" ${EF_S:-60} env PYTHONSAFEPATH=1 PYTHONPATH="$(tree_path "$tree")" \
            ELASTICEP_COMMIT="$c" python3 -m bench.expert_gemv --exchange-forms ${EF_G:-2,4} \
            | sed "s/^{/{\"tree\": \"$tree\", \"tree_commit\": \"$c\", /" \
            >> "$OUT/expert_forms.jsonl" 2> /tmp/ef.err
        tail -2 /tmp/ef.err | cut -c1-300
    done
    cat "$OUT/expert_forms.jsonl"
fi

if want tiled; then  # expert tiles at prefill sizes
    step tiled ${TILED_S:-90} python3 -m bench.tiled_experts --rows ${TILED_ROWS:-16384,65536} \
        > "$OUT/tiled.jsonl" 2> /tmp/tiled.err
    tail -2 /tmp/tiled.err | cut -c1-300
    cut -c1-200 "$OUT/tiled.jsonl"
fi

if want prefill; then
    step prefill ${PREFILL_S:-200} python3 -m bench.scale --only prefill --workdir /tmp/scale \
        --prefill-lens ${PREFILL_LENS:-2048,8192} --prefill-budgets ${PREFILL_BUDGETS:-8192} \
        --prefill-warmup ${PREFILL_ARGS:-} > "$OUT/prefill.jsonl" 2> /tmp/prefill.err
    tail -3 /tmp/prefill.err | cut -c1-300
    cut -c1-400 "$OUT/prefill.jsonl"
fi

if want prefill_ds; then  # DeepSeek-V2-Lite shape (MLA)
    step prefill_ds ${PREFILL_DS_S:-150} python3 -m bench.scale --only prefill \
        --config bench/configs/deepseek-v2-lite.json --workdir /tmp/scale_ds \
        --prefill-lens ${PREFILL_DS_LENS:-2048,8192} --prefill-budgets 8192 --prefill-warmup \
        > "$OUT/prefill_ds.jsonl" 2> /tmp/prefill_ds.err
    tail -3 /tmp/prefill_ds.err | cut -c1-300
    cut -c1-400 "$OUT/prefill_ds.jsonl"
fi

if want decode_ab; then  # no decode regression: older trees (.ab/NAME, carried) and this one
    for round in $(seq 1 ${AB_ROUNDS:-1}); do  # AB_TREES: .ab/ names and "new", interleaved
        trees=${AB_TREES:-old new}  # even rounds run them in reverse (ABBA): drift cancels
        (( round % 2 == 0 )) && trees=$(tr ' ' '\n' <<< "$trees" | tac | tr '\n' ' ')
        for tree in $trees; do
            c=$(tree_commit "$tree") || { echo "SKIPPED decode_${tree}_$round" >&2; continue; }
            step "decode_${tree}_$round" ${AB_S:-100} env PYTHONSAFEPATH=1 \
                PYTHONPATH="$(tree_path "$tree")" ELASTICEP_COMMIT="$c" python3 -m bench.scale \
                --only ep1 --batches ${AB_BATCHES:-1,64,256} --decode-tokens 48 --cuda-graph on \
                --workdir /tmp/scale_ab > /tmp/ab_$tree.jsonl 2> /tmp/ab_$tree.err
            # each line names the commit of the tree that ran it
            sed "s/^{/{\"tree\": \"$tree\", \"tree_commit\": \"$c\", \"round\": $round, /" \
                /tmp/ab_$tree.jsonl \
                | grep '"ep1"' >> "$OUT/decode_ab.jsonl"
            tail -1 /tmp/ab_$tree.err | cut -c1-200
        done
    done
    python3 -c "
import json, statistics as st
by = {}
for l in open('$OUT/decode_ab.jsonl'):
    d=json.loads(l); print(d['tree'], d['round'], d.get('batch'), d.get('decode_step_ms'), d.get('decode_step_ms_p10_p90'), d.get('error', '')[:200])
    if d.get('decode_step_ms'): by.setdefault(d['batch'], {}).setdefault(d['tree'], []).append(d['decode_step_ms'])
for b, t in sorted(by.items()):
    print('batch', b, {k: (round(st.median(v), 3), round(min(v), 3), round(max(v), 3), len(v)) for k, v in t.items()})"
fi

if want ttft; then  # served TTFT of 2048-token prompts at concurrency 1
    step ttft ${TTFT_S:-100} python3 -m bench.serving --launch $Q3 --random-input-len 2048 \
        --random-output-len 8 --random-range-ratio 1 --max-concurrency 1 --num-prompts 8 \
        --serve-arg=--max-ep-size --serve-arg=2 --log-dir /tmp/ttftlog > "$OUT/ttft.jsonl" 2> /tmp/ttft.err
    tail -2 /tmp/ttft.err | cut -c1-300
    cut -c1-700 "$OUT/ttft.jsonl"
    grep -h "warm-up\|pieces each" /tmp/ttftlog/* 2>/dev/null | cut -c1-250 | tail -4
fi

if want failover; then
    for sc in ${SCENARIOS:-kill:0:2 rejoin:0:2 scale-up:0:2}; do  # name:redundant:ep_size[:scale_to]
        IFS=: read -r name r ep to <<< "$sc"
        tag=${name}_r${r}_ep$ep${to:+_to$to}
        step "failover_$tag" ${FO_S:-100} python3 -m bench.failover --scenario $name \
            --ep-size $ep --victim 1 --device cuda --ep-num-redundant-experts $r --healthy-s 4 \
            --degraded-s 4 --after-s 4 ${to:+--scale-to $to} ${FO_ARGS:-} --log-dir /tmp/fo_$tag \
            --step-rate-out "$OUT/steps_$tag.jsonl" >> "$OUT/failover.jsonl" 2>> /tmp/fo.err
        tail -2 /tmp/fo.err
        tail -1 "$OUT/failover.jsonl" | python3 -c "
import json,sys
d=json.loads(sys.stdin.read())
print({k: d.get(k) for k in ('scenario','ep_size','scale_to','redundant','interruption_s','pause_s','failed_requests','outputs_identical','survivor_recaptures','decode_replay_share_healthy','decode_replay_share_event','decode_replay_share_degraded','decode_replay_share_after')})" 2>&1 | cut -c1-700
        grep -h "pieces each\|changed shape\|Traceback\|Error\|reconciled in\|admitted:\|cannot be read\|mapped the expert" /tmp/fo_$tag/* 2>/dev/null \
            | cut -c1-220 | tail -14 >> "$OUT/failover_lines.log"
    done
fi
# The device returns at most 8 files: the step-rate files, rank lines and profiles go
# into one archive beside the main results. They are kept outside $OUT, so that several
# runs of this script in one call (from other trees, say) add to one archive.
KEEP=${EXTRAS_DIR:-/tmp/device_session_extras}
(cd "$OUT" && extras=$(ls | grep -vE '^(gpu_tests.log|fp8_tests.log|fp8_experts.jsonl|fp8_linear.jsonl|fp8_decode.jsonl|exchange.jsonl|expert_forms.jsonl|decode_ab.jsonl|failover.jsonl|sweep.jsonl|prefill.jsonl|prefill_ds.jsonl|ttft.jsonl|host_profile_c1.txt|host_profile_c64.txt|extras.tgz)$') \
    && [[ -n $extras ]] && mkdir -p "$KEEP" && mv $extras "$KEEP"/ \
    && tar -czf extras.tgz -C "$KEEP" . && echo "extras.tgz: +" $extras)
echo "done at ${SECONDS}s"
