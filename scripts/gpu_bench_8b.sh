#!/usr/bin/env bash
# One-call H200 benchmark of the Llama-8B shape: bf16 against transformers eager and static
# cache + torch.compile (batch 1 and 64), and the --int8 (W8A16) artifact, compiled in the
# background while the bf16 baselines run. Writes bench_*.json/png under $OUT.
set -uo pipefail
W=/tmp/dsc-bench
CK=$W/ckpt-llama-8b-bfloat16
python3 -c "
from dsc.compiler.random_checkpoint import make_random_checkpoint
make_random_checkpoint('$CK', 'llama-8b', dtype='bfloat16', device='cuda', tokenizer=False)" && echo "checkpoint ready"
(python3 -m dsc compile $CK -o $W/art-llama-8b-bfloat16-int8 --int8 --max-batch 64 --max-seq 2304 > $OUT/compile-int8.log 2>&1; echo "int8 compile rc=$?") &
timeout 400 python3 scripts/bench_decode.py --shape llama-8b --dtype bfloat16 --hf eager,compile --hf-batches 1,64 2>&1 | grep -v -i warn | grep -v Loading | tail -22
wait
tail -12 $OUT/compile-int8.log
timeout 150 python3 scripts/bench_decode.py --shape llama-8b --dtype bfloat16 --int8 --hf none --profile 2>&1 | grep -v -i warn | tee $OUT/profile_llama-8b-int8.txt | grep -E "step|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+|==|load" | head -30
