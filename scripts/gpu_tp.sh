#!/usr/bin/env bash
# Tensor parallel on several GPUs (issue 8): correctness vs tp=1 and scaling, in one call.
#   bash scripts/gpu_tp.sh [SHAPE] [DTYPE]      (on a machine with 4 GPUs; results in $OUT/results.tgz)
# 1. a random-weight checkpoint; compiles for tp=1,2,4 and int8 tp=1,4 (in parallel on the CPUs,
#    12 threads each: 5 compiles at the default thread count oversubscribe 64 cores and took 8 min)
#    while scripts/check_allreduce_gpu.py checks and times the one-shot all-reduce on 2 and 4 GPUs
#    (NO_AR_CHECK=1 skips it);
# 2. greedy tokens of every tp against tp=1 (torchrun + NCCL, decode steps replayed from CUDA
#    graphs with the all-reduces captured), tp=4 also with DSC_ALLREDUCE=nccl (NO_GEN=1 skips;
#    GEN_MODES="push pull": every tp > 1 artifact again under those modes, against the default;
#    PIPE_AB="tp1 tp2": those artifacts again with DSC_PIPELINE=off, the unpipelined generate loop,
#    against the default, in the generates (same tokens) and the benches (tag -nopipe); GEN_ENV=
#    "VAR=value": every artifact again under it, its tokens against the default's (tag -genenv));
# 3. `dsc bench` per artifact: batch-1 ms/token, batch-64 tokens/s, per-rank GPU memory; tp=2/4
#    five times (bf16): the default (the row-parallel GEMVs push their rows, the fused
#    all-reduce + RMSNorm push kernel, the one-shot all-reduce), DSC_ALLREDUCE=push (the GEMV,
#    then the push kernel),
#    DSC_ALLREDUCE=pull (the pull kernel), DSC_ALLREDUCE=one_shot (no fused kernel)
#    and DSC_ALLREDUCE=nccl, in the same run; the
#    default tp=4 run also profiles a batch-1 step (--profile). NO_BENCH=1 skips all benches,
#    NO_NCCL_BENCH=1 the NCCL ones, NO_MODE_BENCH=1 all but the default; PDL_AB=1 benches every artifact again with the other PDL
#    setting than the default's (DSC_PDL=off at tp=1, on at tp > 1; tags -pdloff / -pdlon; PDL_AB="tp1 tp4": those only;
#    AB_ROUNDS=3: two more rounds of both at batch 1, tags -rN and -pdl{on,off}-rN). ROUNDS=3: two
#    more batch-1 benches of every artifact as it is (tags -rN; not with AB_ROUNDS). ENV_AB="VAR=value":
#    every tp > 1 artifact benched again with that environment (tag -envab; AB_ROUNDS rounds).
#    BENCH_CTX="512 2048": each artifact's batch-1 decode also at those contexts (tags -ctxC).
#    AR_CHECK_N="4": the all-reduce check on 4 GPUs only (default "2 4"; AR_CHECK_TIMEOUT seconds each,
#    default 240: on 4 H200s beside three 8B compiles it took about 85 s, the embedding's checks
#    included, where 120 was the limit). GEMV_PUSH_SWEEP=1: the
#    check also sweeps GEMV push configs at the model's row-parallel shapes (kernels/tuning.json
#    `gemv_push` rows to merge by hand).
#    DURING_COMPILE="CMD": a one-GPU command run on GPU 0 while the artifacts compile (and the
#    all-reduce check runs on every GPU: no multi-GPU job there; session 19's tp generates in it
#    and the check stalled each other until killed).
#    PROFILE_ARTS="tp2 tp4": the artifacts whose benches (and -pdl{on,off} benches) profile a batch-1
#    step (default tp4). BOUND_ARTS="tp1 tp2 tp4": also compiled (tp4 too on 2 GPUs), then rank 0
#    of each decoded on GPU 0 with local stand-ins for its collectives (scripts/tp_local_bound.py:
#    the step each tp would take if its all-reduces were free), after the benches; BOUND_PDL_MODES=
#    "off on": the bound again under those DSC_PDL modes (BOUND_PDL_AB=1: "off"); BOUND_ARGS: more
#    arguments for tp_local_bound.py ("--profile"); BOUND_BASE=DIR: every bound again with the code
#    of the tree DIR (before / after a kernel change on the same artifacts; tags -base); BOUND_ENVS=
#    "VAR=1|VAR=2 OTHER=x": every bound again under each of those environments (tags -envN).
#    BENCH_ENVS="tp2,tp4:DSC_PDL=on|DSC_GEMV_EARLY=4": batch-1 benches of the artifacts under each
#    environment, ENV_ROUNDS rounds, the default first in each (tags -eR-N; see below; with
#    NO_BENCH=1 only these; ENV_PROFILE="tp2": those artifacts' round-1 default bench also profiles
#    a step). AR_CHECK_ENV="VAR=value": the all-reduce check under it.
# If the all-reduce check fails on 4 GPUs, the rest runs with DSC_ALLREDUCE=one_shot.
set -uo pipefail
SHAPE=${1:-llama-8b}
DTYPE=${2:-bfloat16}
# a fresh folder unless WORK names one: the lent hosts keep /tmp between sessions, and an
# artifact left there by another checkout would be benched instead of compiled (session 12
# found another run's checkpoint and results in /tmp/dsc-tp)
W=${WORK:-$(mktemp -d /tmp/dsc-tp.XXXXXX)}
FINAL=${OUT:-$W/out}
OUT=$W/results
# a reused WORK keeps its checkpoint and artifacts, not the last run's results (session 19: its
# bench files and bench-envs.txt lines were summarised and packed with the next run's)
rm -rf "$OUT"
mkdir -p "$W" "$OUT" "$FINAL"
# NVLink multicast stays off (the machines' rule); the one-shot all-reduce does not use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU  $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
pack() { tar czf "$FINAL/results.tgz" -C "$OUT" . ; }  # after every phase: a cut-off call keeps what ran
T0=$SECONDS
python3 - <<PY
from pathlib import Path
from dsc.compiler.random_checkpoint import make_random_checkpoint
p = Path("$W/ckpt")
if not (p / "config.json").exists():
    make_random_checkpoint(p, "$SHAPE", dtype="$DTYPE", device="${DEV:-cuda}", tokenizer=False)
PY
echo "checkpoint: $((SECONDS - T0)) s"
# DURING_COMPILE="CMD": one-GPU work run on GPU 0 while the CPUs compile (the GPUs idle then),
# logged to $OUT/during-compile.log; the generations start once both are done
[ -n "${DURING_COMPILE:-}" ] && (OUT=$OUT CUDA_VISIBLE_DEVICES=0 timeout 360 bash -c "$DURING_COMPILE" > "$OUT/during-compile.log" 2>&1;
  echo "during-compile: rc=$? $((SECONDS - T0)) s") &
ARTS=${ARTS:-"tp1 tp2 tp4 tp1-int8 tp4-int8"}
[ "$NGPU" -lt 4 ] && ARTS=$(for A in $ARTS; do [[ $A == tp4* ]] || echo -n "$A "; done)  # what fits
for A in $(echo $ARTS ${BOUND_ARTS:-} | tr ' ' '\n' | sort -u); do
  TP=${A#tp}; TP=${TP%-int8}; INT8=""; [[ $A == *int8 ]] && INT8="--int8"
  [ -f "$W/$A/manifest.json" ] || (OMP_NUM_THREADS=12 python3 -m dsc compile "$W/ckpt" -o "$W/$A" --tp "$TP" $INT8 \
      --max-batch 64 --max-seq 1024 > "$OUT/compile-$A.log" 2>&1; echo "compiled $A: rc=$? $((SECONDS - T0)) s") &
done
for N in ${AR_CHECK_N:-2 4}; do
  [ "$NGPU" -ge $N ] && [ -z "${NO_AR_CHECK:-}" ] || continue
  # shellcheck disable=SC2086  # AR_CHECK_ENV="VAR=value ...": the check under that environment
  env ${AR_CHECK_ENV:-} OUT=$OUT timeout $([ -n "${GEMV_PUSH_SWEEP:-}" ] && echo 420 || echo "${AR_CHECK_TIMEOUT:-240}") torchrun --nproc-per-node $N scripts/check_allreduce_gpu.py > "$OUT/allreduce-tp$N.log" 2>&1
  RC=$?
  echo "check_allreduce tp$N: rc=$RC $((SECONDS - T0)) s"
  python3 - "$OUT/allreduce-tp$N.json" <<'PY'
import json, sys, os
if os.path.exists(sys.argv[1]):
    r = json.load(open(sys.argv[1]))
    print(" path", r["path"], "checks", {k: v for k, v in r.items() if k.startswith("check_")},
          "wrong per rank", r.get("wrong_per_rank"), "one-buffer control", r.get("control_one_buffer_wrong"))
    nan = float("nan")
    t1 = r["timing_bf16_x4096"].get("1", {})
    if "gemv_push_norm_us" in t1:
        print(f"  [1, 1024] x [4096, 1024]^T + all-reduce + add + RMSNorm: GEMV then push kernel "
              f"{t1['gemv_then_push_norm_us']:.2f} us, GEMV pushing its rows {t1['gemv_push_norm_us']:.2f} us; "
              + ", ".join(f"{k[18:]} {v:.2f}" for k, v in t1.items() if k.startswith("gemv_push_norm_us_")))
    for shape, sw in (r.get("gemv_push_sweep") or {}).items():  # GEMV_PUSH_SWEEP=1
        print(f"  GEMV push sweep {shape}: " + (str(sw) if shape == "error" else
              f"table config {sw['table_us']:.2f} us, GEMV then push kernel {sw['gemv_then_push_us']:.2f} us, "
              f"best row {json.dumps(sw['row'])}"))
    for rows, t in r["timing_bf16_x4096"].items():
        print(f"  [{rows}, 4096] bf16: one-shot {t.get('one_shot_us', nan):.2f} us, nccl {t['nccl_us']:.2f} us; "
              f"+ add + RMSNorm: fused push {t.get('fused_push_norm_us', nan):.2f}, pull "
              f"{t.get('fused_pull_norm_us', nan):.2f}, one-shot + norm "
              f"{t.get('one_shot_then_norm_us', nan):.2f}, nccl + norm {t['nccl_then_norm_us']:.2f} us")
PY
  tail -3 "$OUT/allreduce-tp$N.log"
  if [ "$RC" != 0 ]; then echo "all-reduce check failed on $N GPUs: DSC_ALLREDUCE=one_shot from here"; export DSC_ALLREDUCE=one_shot; fi
done
wait
for A in $ARTS; do  # the plan's decode launches per step and per layer
  [ -f "$W/$A/plan.json" ] && python3 -m dsc inspect "$W/$A" --json 2>/dev/null | python3 -c "import json, sys
d = json.load(sys.stdin)['notes']['kernels']['launches']['decode']
print('$A decode launches: %(launches)d per step, %(launches_per_layer)d per layer x %(layers)d layers' % d)"
done
pack
PROMPTS='--token-ids 1,2,3,4,5,6,7,8,9,10,11 --token-ids 20,21,22 --token-ids 30,31,32,33,34,35,36'
gen() {  # gen TAG ARTIFACT [env...]
  local tag=$1 a=$2; shift 2
  env "$@" timeout 120 python3 -m dsc generate "$W/$a" $PROMPTS --max-new-tokens 24 --no-verify > "$OUT/tokens-$tag.jsonl" 2> "$OUT/generate-$tag.log"
}
same() {  # same A B: how many of the generated tokens agree (position by position)
  python3 - "$OUT/tokens-$1.jsonl" "$OUT/tokens-$2.jsonl" "$1" "$2" <<'PY'
import json, sys
def toks(p):
    try:
        return [json.loads(l)["tokens"] for l in open(p) if l.strip()]
    except Exception as e:
        return None
a, b = toks(sys.argv[1]), toks(sys.argv[2])
if not a or not b:
    print(f"{sys.argv[3]} vs {sys.argv[4]}: missing output"); sys.exit()
eq = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)); n = sum(len(s) for s in a)
first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
print(f"{sys.argv[3]} vs {sys.argv[4]}: {eq}/{n} tokens equal; first difference per prompt at {first}")
PY
}
if [ -z "${NO_GEN:-}" ]; then
  for A in $ARTS; do gen "$A" "$A"; done
  [[ " $ARTS " == *" tp4 "* ]] && gen tp4-nccl tp4 DSC_ALLREDUCE=nccl
  for M in ${GEN_MODES:-}; do  # e.g. GEN_MODES=push: the same artifacts under DSC_ALLREDUCE=push
    for A in $ARTS; do [[ $A == tp1* ]] || gen "$A-$M" "$A" DSC_ALLREDUCE=$M; done
  done
  echo "generate done: $((SECONDS - T0)) s"
  for A in $ARTS; do
    BASE=tp1; [[ $A == *int8 ]] && BASE=tp1-int8
    [ "$A" != "$BASE" ] && same "$BASE" "$A"
  done
  [[ " $ARTS " == *" tp4 "* ]] && same tp4-nccl tp4
  for M in ${GEN_MODES:-}; do for A in $ARTS; do [[ $A == tp1* ]] || same "$A" "$A-$M"; done; done
  for A in ${PIPE_AB:-}; do gen "$A-nopipe" "$A" DSC_PIPELINE=off; same "$A" "$A-nopipe"; done
  # GEN_ENV="DSC_L2_PREFETCH=24": every artifact generated again under it (tag -genenv), its
  # tokens against the default's (a setting that changes no value must give 72/72)
  # shellcheck disable=SC2086  # VAR=value words
  [ -n "${GEN_ENV:-}" ] && for A in $ARTS; do gen "$A-genenv" "$A" $GEN_ENV; same "$A" "$A-genenv"; done
  [[ " $ARTS " == *" tp1-int8 "* ]] && same tp1 tp1-int8
  grep -h "one-shot\|fused\|unavailable" "$OUT"/generate-*.log | sort | uniq -c | head -5
  pack
fi
bench() {  # bench TAG ARTIFACT [env...]; PROFILE=1: also --profile
  local tag=$1 a=$2; shift 2
  env "$@" timeout 150 python3 -m dsc bench "$W/$a" ${BENCH_ARGS:---batch 1 --batch 64 --prefill 128 --prefill 1000} --iters 30 \
    ${PROFILE:+--profile} --json "$OUT/bench-$tag.json" > "$OUT/bench-$tag.txt" 2>&1
  grep -v -i warn "$OUT/bench-$tag.txt" | grep -v "^    model.layers" | tail -${TAIL:-9}
}
if [ -z "${NO_BENCH:-}" ]; then
  for A in $ARTS; do
    PROF=""; [[ " ${PROFILE_ARTS:-tp4} " == *" $A "* ]] && PROF=1
    if [ -n "$PROF" ]; then PROFILE=1 TAIL=40 bench "$A" "$A"; else bench "$A" "$A"; fi
    for C in ${BENCH_CTX:-}; do  # batch-1 decode again with C tokens in the cache (the default: 128)
      BENCH_ARGS="--batch 1 --prefill 128 --context $C" bench "$A-ctx$C" "$A"
    done
    if [ "${PDL_AB:-}" = 1 ] || [[ " ${PDL_AB:-} " == *" $A "* ]]; then  # the other PDL setting than the default's
      ALT=off; [[ $A == tp1* ]] || ALT=on  # DSC_PDL=auto: on at tp=1, off under tensor parallelism
      if [ -n "$PROF" ]; then PROFILE=1 TAIL=40 bench "$A-pdl$ALT" "$A" DSC_PDL=$ALT; else bench "$A-pdl$ALT" "$A" DSC_PDL=$ALT; fi
      for R in $(seq 2 "${AB_ROUNDS:-1}"); do  # AB_ROUNDS=N: N rounds of default / other, batch 1 only
        BENCH_ARGS="--batch 1" TAIL=3 bench "$A-r$R" "$A"
        BENCH_ARGS="--batch 1" TAIL=3 bench "$A-pdl$ALT-r$R" "$A" DSC_PDL=$ALT
      done
    fi
    [[ " ${PIPE_AB:-} " == *" $A "* ]] && BENCH_ARGS="--batch 1" bench "$A-nopipe" "$A" DSC_PIPELINE=off
    if [ -n "${ENV_AB:-}" ] && [[ $A != tp1* ]]; then  # ENV_AB="VAR=value": tp > 1 again with it (tag -envab),
      bench "$A-envab" "$A" $ENV_AB                    # AB_ROUNDS=N: N rounds of both, batch 1
      for R in $(seq 2 "${AB_ROUNDS:-1}"); do
        BENCH_ARGS="--batch 1 --prefill 128" TAIL=4 bench "$A-r$R" "$A"
        BENCH_ARGS="--batch 1 --prefill 128" TAIL=4 bench "$A-envab-r$R" "$A" $ENV_AB
      done
    fi
    for R in $(seq 2 "${ROUNDS:-1}"); do  # ROUNDS=N: N - 1 more batch-1 benches of the default (tags -rN)
      BENCH_ARGS="--batch 1 --prefill 128" TAIL=4 bench "$A-r$R" "$A"
    done
    if [[ $A != tp1* && $A != *int8 ]]; then
      [ -n "${NO_MODE_BENCH:-}" ] || bench "$A-push" "$A" DSC_ALLREDUCE=push
      [ -n "${NO_MODE_BENCH:-}" ] || bench "$A-pull" "$A" DSC_ALLREDUCE=pull
      [ -n "${NO_MODE_BENCH:-}" ] || bench "$A-oneshot" "$A" DSC_ALLREDUCE=one_shot
      [ -n "${NO_NCCL_BENCH:-}${NO_MODE_BENCH:-}" ] || bench "$A-nccl" "$A" DSC_ALLREDUCE=nccl
    fi
    pack
  done
fi
# BENCH_ENVS="tp2,tp4:DSC_PDL=on|DSC_GEMV_EARLY=4": batch-1 benches under each '|'-separated
# environment ("tp2,tp4:" first: those artifacts only; else every one of ARTS), ENV_ROUNDS rounds
# (default 1), each round of an artifact the default first: tags -eR-0 (default), -eR-1, ...
# (runs with NO_BENCH=1 too)
if [ -n "${BENCH_ENVS:-}" ]; then
  IFS='|' read -ra ENV_LIST <<< "$BENCH_ENVS"
  ENV_ARTS=() ENV_VARS=()  # per environment i (from 1): the artifacts it applies to, its VAR=value words
  for E in "${ENV_LIST[@]}"; do
    arts=$ARTS; vars=$E
    # (a value may hold ':' too, as DSC_ATTN_PRE=128:8: only a leading list of artifacts is one)
    if [[ $E =~ ^(tp[0-9]+(-int8)?(,tp[0-9]+(-int8)?)*):(.*)$ ]]; then
      arts=${BASH_REMATCH[1]//,/ }; vars=${BASH_REMATCH[5]}
    fi
    ENV_ARTS+=("$arts"); ENV_VARS+=("$vars")
    echo "env ${#ENV_VARS[@]}: $vars (on $arts)" | tee -a "$OUT/bench-envs.txt"
  done
  for R in $(seq 1 "${ENV_ROUNDS:-1}"); do
    for A in $ARTS; do
      P=""; [ "$R" = 1 ] && [[ " ${ENV_PROFILE:-} " == *" $A "* ]] && P=1  # ENV_PROFILE="tp2": round 1's default profiled
      BENCH_ARGS="--batch 1" TAIL=3 PROFILE=$P bench "$A-e$R-0" "$A"
      for i in "${!ENV_VARS[@]}"; do
        # shellcheck disable=SC2086  # VAR=value words
        [[ " ${ENV_ARTS[$i]} " == *" $A "* ]] && BENCH_ARGS="--batch 1" TAIL=3 bench "$A-e$R-$((i + 1))" "$A" ${ENV_VARS[$i]}
      done
      pack
    done
  done
fi
echo "bench done: $((SECONDS - T0)) s"
if [ -n "${BOUND_ARTS:-}" ]; then
  bound() {  # bound DIR TXT TREE [VAR=value...]: TREE's tp_local_bound.py over the BOUND_ARTS, JSON in DIR
    local dir=$1 txt=$2 tree=$3; shift 3
    mkdir -p "$dir"
    env "$@" OUT=$dir CUDA_VISIBLE_DEVICES=0 timeout 300 python3 "$tree/scripts/tp_local_bound.py" \
      $(for A in $BOUND_ARTS; do echo -n "$W/$A "; done) ${BOUND_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/$txt"
  }
  # BOUND_ARGS="--profile": also each artifact's profile, with exposed times
  bound "$OUT" tp_local_bound.txt .
  # BOUND_PDL_MODES="off on": the bound again under those DSC_PDL modes (BOUND_PDL_AB=1: "off")
  for M in ${BOUND_PDL_MODES:-${BOUND_PDL_AB:+off}}; do
    bound "$OUT/bound-pdl$M" "tp_local_bound-pdl$M.txt" . DSC_PDL=$M
  done
  # BOUND_ENVS="A=1|A=2 B=off": the bound again under each '|'-separated environment (tags -env1, -env2, ...)
  if [ -n "${BOUND_ENVS:-}" ]; then
    i=0
    IFS='|' read -ra BOUND_ENV_LIST <<< "$BOUND_ENVS"
    for E in "${BOUND_ENV_LIST[@]}"; do
      i=$((i + 1))
      echo "bound env$i: $E" | tee -a "$OUT/bound-envs.txt"
      # shellcheck disable=SC2086  # E: VAR=value words
      bound "$OUT/bound-env$i" "tp_local_bound-env$i.txt" . $E
      pack
    done
  fi
  # BOUND_BASE=DIR: each of those bounds again, after them, with the code of another tree
  # (e.g. `git archive` of the commit before a kernel change) imported as dsc, on the same
  # artifacts (the runtime compiles kernels at load): before and after in one call (-base tags)
  if [ -n "${BOUND_BASE:-}" ]; then
    mkdir -p /tmp/dsc-base-pkg && ln -sfn "$(realpath "$BOUND_BASE")" /tmp/dsc-base-pkg/dsc
    for M in default ${BOUND_PDL_MODES:-${BOUND_PDL_AB:+off}}; do
      bound "$OUT/bound-base-$M" "tp_local_bound-base-$M.txt" "$BOUND_BASE" \
        PYTHONPATH="/tmp/dsc-base-pkg:${PYTHONPATH:-}" $([ "$M" != default ] && echo DSC_PDL=$M)
      pack
    done
  fi
  echo "bound done: $((SECONDS - T0)) s"
  pack
fi
python3 - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
rows = {}
for f in sorted(os.listdir(out)):
    if f.startswith("bench-") and f.endswith(".json"):
        rows[f[6:-5]] = json.load(open(os.path.join(out, f)))
order = sorted(rows, key=lambda t: ("int8" in t, "-ctx" in t, t.partition("-ctx")[2], int(t[2]), "-pdl" in t, "push" in t, "pull" in t, "oneshot" in t,
                                   "nccl" in t))
# batch 1, ms: the step alone (synced after each: the issue's ratio since session 4), steps queued
# back to back (`dsc bench`'s queued column), and generate per token (pipelined, everything in)
print(f"{'artifact':>14} {'all-reduce':>18} {'pdl':>4} {'b1 ms/tok':>10} {'vs tp1':>7} {'queued':>7} {'vs tp1':>7} "
      f"{'generate':>8} {'vs tp1':>7} {'b64 tok/s':>10} {'vs tp1':>7} {'weights/rank GiB':>17}")
def ratio(a, b):
    return f"{a / b:>6.3f}x" if a and b else f"{'-':>7}"
for tag in order:
    r = rows[tag]
    base = rows.get("tp1-int8" if "int8" in tag else "tp1" + (tag[tag.index("-ctx"):] if "-ctx" in tag else "")) or {}
    env = re.match(r"tp\d+(-int8)?-e(\d+)-(\d+)$", tag)  # BENCH_ENVS: tp1 of the same round, same env or default
    if env:
        t1 = f"tp1{env[1] or ''}-e{env[2]}"
        base = rows.get(f"{t1}-{env[3]}") or rows.get(f"{t1}-0") or {}
    d1, d64 = r["decode"].get("1") or {}, r["decode"].get("64") or {}
    b1, b64 = base.get("decode", {}).get("1") or {}, base.get("decode", {}).get("64") or {}
    g, bg = (r.get("generate") or {}).get("ms_per_token"), (base.get("generate") or {}).get("ms_per_token")
    mem = r.get("memory_per_rank") or [r.get("memory")]
    w = "/".join(f"{m['weights'] / 2**30:.2f}" for m in mem if m)
    print(f"{tag:>14} {r.get('all_reduce', '-'):>18} {r.get('pdl', '-'):>4} {d1.get('ms_per_step', 0):>10.3f} "
          f"{ratio(d1.get('ms_per_step'), b1.get('ms_per_step'))} {d1.get('ms_per_step_queued', 0):>7.3f} "
          f"{ratio(d1.get('ms_per_step_queued'), b1.get('ms_per_step_queued'))} {g or 0:>8.3f} {ratio(g, bg)} "
          f"{d64.get('tokens_per_s', 0):>10.0f} {ratio(d64.get('tokens_per_s'), b64.get('tokens_per_s'))} {w:>17}")
PY
pack
