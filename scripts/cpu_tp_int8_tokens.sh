#!/usr/bin/env bash
# int8 greedy tokens at tp=2 against tp=1 on CPU (gloo ranks, started by `dsc generate`):
# a random fp32 Llama-1B-shaped checkpoint cut to LAYERS decoder layers, compiled with --int8
# at tp 1 and 2 (per-channel W8A16), two prompts (37 and 5 tokens), 24 new tokens each.
# Since session 20 a row-parallel shard takes its whole rows' scales, so the tokens are equal;
# before, each shard had its own (23/48 equal in session 20's run).
#   bash scripts/cpu_tp_int8_tokens.sh [WORKDIR]      (about 2 minutes on 2 cores)
set -euo pipefail
W=${1:-$(mktemp -d /tmp/dsc-int8-tp.XXXXXX)}
LAYERS=${LAYERS:-4}
python - "$W" "$LAYERS" <<'PY'
import sys
from pathlib import Path

import dsc
from dsc.compiler.random_checkpoint import make_random_checkpoint

w, layers = Path(sys.argv[1]), int(sys.argv[2])
ck = w / "ckpt"
if not (ck / "config.json").exists():
    make_random_checkpoint(ck, "llama-1b", dtype="float32", num_hidden_layers=layers, tokenizer=False)
for tp in (1, 2):
    dsc.compile(str(ck), w / f"tp{tp}-int8", dtype="fp32", int8=True, tp=tp, max_batch=4, max_seq=128)
PY
ids() { python -c "import torch; g=torch.Generator().manual_seed($1); print(','.join(map(str, torch.randint(0, 128256, ($2,), generator=g).tolist())))"; }
P1=$(ids 0 37); P2=$(ids 1 5)
for tp in 1 2; do
  python -m dsc generate "$W/tp$tp-int8" --device cpu --token-ids "$P1" --token-ids "$P2" \
    --max-new-tokens 24 --stop-token -1 > "$W/tokens-tp$tp-int8.txt"
done
python - "$W" <<'PY'
import json
import sys

def tokens(p):
    return [json.loads(line)["tokens"] for line in open(p) if line.startswith("{")]

a, b = (tokens(f"{sys.argv[1]}/tokens-tp{tp}-int8.txt") for tp in (1, 2))
same = sum(x == y for r, s in zip(a, b) for x, y in zip(r, s))
print(f"tp2-int8 vs tp1-int8: {same}/{sum(map(len, a))} greedy tokens equal")
sys.exit(0 if a == b else 1)
PY
