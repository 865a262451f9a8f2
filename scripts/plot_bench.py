"""Draw decode latency/throughput from bench_decode.py JSON files.

    python scripts/plot_bench.py bench_llama-8b-bfloat16.json ... -o bench.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(files: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for f in files:
        r = json.loads(Path(f).read_text())
        tag = f"{r['shape']} {r['dtype']}{' int8' if r.get('int8') else ''}"
        for key, style in (("dsc", "-o"), ("hf_eager", "--s"), ("hf_compile", ":^")):
            d = r["dsc"]["decode"] if key == "dsc" else r.get(key, {}).get("decode", {})
            if not d:
                continue
            bs = sorted(int(b) for b in d)
            axes[0].plot(bs, [d[str(b)]["ms_per_step"] if str(b) in d else d[b]["ms_per_step"] for b in bs], style, label=f"{tag} {key}")
            axes[1].plot(bs, [d[str(b)]["tokens_per_s"] if str(b) in d else d[b]["tokens_per_s"] for b in bs], style, label=f"{tag} {key}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per decode step", title="decode latency")
    axes[1].set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="decode throughput")
    for a in axes:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--out", default="bench.png")
    a = ap.parse_args()
    plot([Path(f) for f in a.files], Path(a.out))
