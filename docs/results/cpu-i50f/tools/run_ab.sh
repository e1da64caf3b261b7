#!/bin/bash
# One stamped stub run: run_ab.sh TAG C NUM_PROMPTS [VAR=VALUE ...], from the repository
# root. Writes $OUT_DIR/TAG.jsonl (the bench's line), $OUT_DIR/TAG (the server's stamps)
# and $OUT_DIR/TAG.client (the client's). VAR=VALUE pairs go to the environment
# (STAMPS_INLINE_CHARS=1024: main's inline-tokenize limit; PYTHONPATH_EXTRA=DIR: a
# directory put on the server's and client's path, e.g. one holding uvloop and httptools).
set -eu
TAG=$1; C=$2; N=$3; shift 3
OUT_DIR=${OUT_DIR:-/tmp/i50f}
mkdir -p "$OUT_DIR"
env "$@" sh -c 'PYTHONPATH=$PWD${PYTHONPATH_EXTRA:+:$PYTHONPATH_EXTRA} STAMPS_OUT='"$OUT_DIR/$TAG"' \
  '"${PYTHON:-python}"' docs/results/cpu-i50f/tools/stamps_bench.py --launch \
  --stub-engine-steps-per-s 36 --num-prompts '"$N"' --max-concurrency '"$C"' \
  --random-input-len 256 --random-output-len 256 --random-range-ratio 1 --ignore-eos \
  --output-file '"$OUT_DIR/$TAG.jsonl"' > '"$OUT_DIR/$TAG.out"' 2>&1'
