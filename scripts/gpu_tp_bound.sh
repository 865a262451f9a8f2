#!/usr/bin/env bash
# One GPU: the tensor-parallel lower bound (scripts/tp_local_bound.py) at a model shape.
#   bash scripts/gpu_tp_bound.sh [SHAPE] [DTYPE]     (default llama-8b bfloat16; $OUT/results.tgz)
# gpu_tp.sh with no multi-GPU step: a random-weight checkpoint, compiled for tp 1, 2 and 4 in
# parallel on the CPUs, then rank 0 of each decoded on this one GPU with its collectives replaced
# by local stand-ins (no peer, no NVLink): the batch-1 step each tp would take if its all-reduces
# were free, against tp=1 (BOUND_ARTS="tp1 tp2" for fewer).
exec env ARTS=" " BOUND_ARTS="${BOUND_ARTS:-tp1 tp2 tp4}" NO_AR_CHECK=1 NO_GEN=1 NO_BENCH=1 \
  bash "$(dirname "$0")/gpu_tp.sh" "$@"
