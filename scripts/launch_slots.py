"""A decode step's time per launch slot of a layer, from profiles' `launches` (runtime/profile.py).

    python3 scripts/launch_slots.py RUN.json [RUN2.json ...] [--tp 2] [--layer 15]

Each RUN is `dsc bench --json`'s file (with --profile) or tp_local_bound.py's (with --profile;
one row per artifact, --tp picks it). A decoder layer's launches repeat with a period found
from the attention kernel's launches (one per layer); the step's launches are folded onto
that period, and each slot's exposed time (what it adds past the kernels before it) plus the
gap before it is summed over the layers. Launches outside the layers (embedding, final norm,
lm_head, the logits' gather) are listed one by one. With two or more runs (e.g. DSC_PDL on and
off, or before and after a change) the columns sit side by side, so a per-kernel difference
can be read per slot. Runs whose layers have different launches (the real step's GEMV that
ends an all-reduce and normalizes, the one-GPU bound's GEMV, then norm) line up with each norm
kernel merged into the slot before it.
"""
from __future__ import annotations

import argparse
import json
import sys

ATTENTION_KERNELS = ("_decode_kernel",)


def _profile(path: str, tp: int | None) -> dict:
    data = json.load(open(path))
    if isinstance(data, list):  # tp_local_bound.py: one row per artifact
        rows = [r for r in data if tp is None or r["tp"] == tp]
        if not rows:
            sys.exit(f"{path}: no row with tp={tp}")
        data = rows[0]
    prof = data.get("profile")
    if not prof or not prof.get("launches"):
        sys.exit(f"{path}: no profile with `launches` (profile with --profile; every step must run "
                 f"the same launches)")
    return prof


def slots(prof: dict) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int]:
    """(per-slot [(kernel, us summed over layers)], outside-layer [(kernel, us)], layers)."""
    la = prof["launches"]
    idx = [i for i, r in enumerate(la) if r["name"] in ATTENTION_KERNELS]
    if len(idx) < 2:
        raise ValueError("fewer than two attention launches: cannot find the layer period")
    period, n = idx[1] - idx[0], len(idx)

    def repeats(s: int) -> bool:  # the launches [s, s + period) recur with the same names in every layer
        return s >= 0 and s + n * period <= len(la) and all(
            la[s + L * period + k]["name"] == la[s + k]["name"] for L in range(n) for k in range(period))

    # a layer starts as far before its attention as the repeating names allow
    backs = [b for b in range(period) if repeats(idx[0] - b)]
    if not backs:
        raise ValueError("the launches do not repeat layer by layer")
    start = idx[0] - max(backs)
    end = start + n * period
    # each launch's cost: its exposed time plus the idle gap before it (a kernel that starts
    # after every earlier one ended); they add up to the step
    cost, last_end = [], float("-inf")
    for r in la:
        cost.append(r["exposed_us"] + max(0.0, r["start_us"] - last_end) if cost else r["exposed_us"])
        last_end = max(last_end, r["start_us"] + r["us"])
    per = [(la[start + k]["name"], sum(cost[start + L * period + k] for L in range(n))) for k in range(period)]
    outside = [(r["name"], cost[i]) for i, r in enumerate(la) if not start <= i < end]
    return per, outside, n


NORM_KERNELS = ("_rmsnorm_kernel", "_add_rmsnorm_kernel")


def merge_norms(per: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """A layer's slots with each norm kernel's folded into the slot before it ("gemv + norm"):
    how the one-GPU bound's GEMV, then norm, lines up with the real step's GEMV that ends the
    all-reduce and normalizes in one launch."""
    out: list[tuple[str, float]] = []
    for name, us in per:
        if name in NORM_KERNELS and out:
            prev, prev_us = out[-1]
            out[-1] = (f"{_short(prev)} + norm", prev_us + us)
        else:
            out.append((name, us))
    return out


def _short(name: str) -> str:
    return name.split("<")[0].replace("void ", "").replace("at::native::", "")[:40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--tp", type=int, default=None, help="the artifact's tp in tp_local_bound.py's JSON")
    args = ap.parse_args()
    profs = [_profile(p, args.tp) for p in args.runs]
    tables = [slots(p) for p in profs]
    print("us per step; layer slots summed over the layers (exposed time + the gap before it)")
    print(f"{'slot':<46}" + "".join(f"{'run ' + str(i + 1):>10}" for i in range(len(profs))))
    print(f"{'step (profiled)':<46}" + "".join(f"{p['step_us']:>10.1f}" for p in profs))
    if len({len(t[0]) for t in tables}) != 1:
        for i, t in enumerate(tables):
            print(f"run {i + 1}: {t[2]} layers of {len(t[0])} launches: " + ", ".join(_short(n) for n, _ in t[0]))
        # e.g. the real tp=2 step (GEMVs that end the all-reduce with its norm) against the
        # bound's (a GEMV, then a norm kernel): line them up with each norm in the slot before it
        tables = [(merge_norms(per), outside, n) for per, outside, n in tables]
        if len({len(t[0]) for t in tables}) != 1:
            sys.exit("the runs' layers differ in their launches, with the norms merged too: compare them one by one")
        print("slots lined up with each norm kernel merged into the launch before it (slot names: run 1's)")
    for k, (name, _) in enumerate(tables[0][0]):
        print(f"{k:>2} {_short(name):<43}" + "".join(f"{t[0][k][1]:>10.1f}" for t in tables))
    print("outside the layers:")
    for i, t in enumerate(tables):
        print(f"  run {i + 1}: " + ", ".join(f"{_short(n)} {us:.1f}" for n, us in t[1]))


if __name__ == "__main__":
    main()
