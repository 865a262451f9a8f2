"""`dsc eval ARTIFACT [--text FILE] [--against B]`: an artifact's quality on natural text.

The text (the built-in sample, compiler/data/sample.txt, by default) is tokenized with the
artifact's tokenizer and cut into windows of `seq` tokens, at most `max_tokens` in all. The
artifact's prefill program runs on them teacher-forced, with the logits of every position
taken (compiler/simulate.py: every tensor-parallel rank in this process, the weights read
from the rank files, computed in the artifact's dtype), which gives

    perplexity   exp(mean over positions of -log P(next token)), the last position of each
                 window excepted (its next token is in the next window)

and, against B (a second artifact, run the same way, or a checkpoint: a folder, a hub id in
the local cache or a .gguf file, run by transformers in float32), at every position:

    logits SQNR  10 log10(sum ref^2 / sum (ref - x)^2) dB, B the reference
    KL           mean KL(P_B || P_artifact)
    top-1        how often both pick the same token

the measures of the `--int8` report (compiler/int8_report.py), which takes fewer positions.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from dsc.errors import UserError

WINDOWS_PER_RUN = 4  # windows in one run of the program (each run reads every weight once)


def _open(path: Path):
    from dsc.runtime.artifact import open_artifact

    art = open_artifact(path)
    tok = art.tokenizer()
    return art, tok


def _artifact_logits(art, windows: list[list[int]]) -> torch.Tensor:
    """Logits [sum of window lengths, V] fp32 of the artifact at every position of every window."""
    from dsc.compiler.int8_report import RankFiles
    from dsc.compiler.simulate import Simulator
    from dsc.runtime.plan import build_graph

    graph, _ = build_graph(
        art.plan["programs"]["prefill"]["nodes"],
        torch.device("cpu"),
        where=f"{art.path / 'plan.json'}: program 'prefill'",
    )
    model = SimpleNamespace(programs={"prefill": graph}, kv_cache=art.plan["kv_cache"])
    out = []
    with RankFiles(art.path, art.tp) as files:
        longest = max(map(len, windows))
        sim = Simulator(
            model,
            files.tensor,
            art.tp,
            batch=min(WINDOWS_PER_RUN, len(windows)),
            seq=max(2, longest),
            weight_bytes=sum(p.stat().st_size for p in art.path.glob("rank*.safetensors")),
        )
        for i in range(0, len(windows), WINDOWS_PER_RUN):
            batch = windows[i : i + WINDOWS_PER_RUN]
            out.append(sim.logits_at(batch, longest))
    return torch.cat(out)


def _checkpoint_logits(checkpoint: str, windows: list[list[int]]) -> torch.Tensor:
    from dsc.compiler.verify import reference_model

    try:
        model = reference_model(checkpoint, torch.float32)
    except (OSError, ValueError) as e:
        raise UserError(
            f"--against {checkpoint}: not an artifact, and transformers cannot load it as a "
            f"checkpoint ({str(e).splitlines()[0]})"
        ) from None
    with torch.no_grad():
        return torch.cat([model(torch.tensor([w])).logits[0].float() for w in windows])


def windows_of(ids: list[int], seq: int, max_tokens: int) -> list[list[int]]:
    ids = ids[:max_tokens]
    return [ids[i : i + seq] for i in range(0, len(ids), seq) if len(ids[i : i + seq]) >= 2]


def perplexity(logits: torch.Tensor, windows: list[list[int]]) -> float:
    nll, n, row = 0.0, 0, 0
    for w in windows:
        lp = logits[row : row + len(w) - 1].double().log_softmax(-1)  # positions 0..L-2 predict 1..L-1
        nll -= float(lp.gather(1, torch.tensor(w[1:])[:, None]).sum())
        n += len(w) - 1
        row += len(w)
    return math.exp(nll / n)


def metrics(ref: torch.Tensor, x: torch.Tensor, rows: int = 256) -> dict:
    """int8_report.logits_metrics of ref, x [positions, V], summed a block of rows at a time
    (in float64, as there: a whole [positions, V] copy would be gigabytes at a 128K vocabulary)."""
    from dsc.compiler.rank_files import sqnr_db

    signal = noise = kl = 0.0
    agree = 0
    for a in range(0, ref.shape[0], rows):
        r, q = ref[a : a + rows].double(), x[a : a + rows].double()
        lp, lq = r.log_softmax(-1), q.log_softmax(-1)
        signal += float(r.pow(2).sum())
        noise += float((r - q).pow(2).sum())
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += int((r.argmax(-1) == q.argmax(-1)).sum())
    n = ref.shape[0]
    return {
        "sqnr_db": round(sqnr_db(signal, noise), 3),
        "kl_div": round(kl / n, 6),
        "top1_agreement": round(agree / n, 4),
        "positions": n,
    }


def evaluate(
    artifact: str | Path,
    text: str | Path | None = None,
    against: str | None = None,
    seq: int = 128,
    max_tokens: int = 1024,
) -> dict:
    from dsc.compiler.sample_text import read_text

    art, tok = _open(Path(artifact))
    if tok is None:
        raise UserError(f"{artifact}: the artifact has no tokenizer, so it cannot read a text")
    if seq < 2 or max_tokens < 2:
        raise UserError("--seq and --max-tokens: at least 2 tokens")
    seq = min(seq, int(art.plan["limits"]["max_seq"]))
    ids = tok.encode(read_text(text), add_special_tokens=False).ids
    vocab = int(art.plan["model"]["vocab_size"])
    if ids and max(ids) >= vocab:
        raise UserError(f"{artifact}: its tokenizer gives token id {max(ids)}, outside the vocabulary (0..{vocab - 1})")
    windows = windows_of(ids, seq, max_tokens)
    if not windows:
        raise UserError(f"{text or 'the sample text'}: fewer than 2 tokens")
    logits = _artifact_logits(art, windows)
    out = {
        "artifact": str(artifact),
        "text": str(text) if text else "built-in sample",
        "tokens": sum(map(len, windows)),
        "windows": len(windows),
        "window_tokens": seq,
        "perplexity": round(perplexity(logits, windows), 4),
    }
    if against is not None:
        if (Path(against) / "manifest.json").is_file():
            b_art, _ = _open(Path(against))
            if int(b_art.plan["model"]["vocab_size"]) != vocab:
                raise UserError(
                    f"--against {against}: vocabulary of {b_art.plan['model']['vocab_size']} tokens, "
                    f"the artifact's is {vocab}"
                )
            ref = _artifact_logits(b_art, windows)
        else:
            ref = _checkpoint_logits(against, windows)
            if ref.shape[-1] != logits.shape[-1]:
                raise UserError(
                    f"--against {against}: logits over {ref.shape[-1]} tokens, the artifact's over {logits.shape[-1]}"
                )
        out["against"] = {
            "model": str(against),
            "perplexity": round(perplexity(ref, windows), 4),
            **metrics(ref, logits),
        }
    return out


def summary(r: dict) -> str:
    lines = [
        f"{r['artifact']}: perplexity {r['perplexity']:.3f} on {r['tokens']} tokens of {r['text']} "
        f"({r['windows']} windows of up to {r['window_tokens']})"
    ]
    if "against" in r:
        a = r["against"]
        lines.append(
            f"against {a['model']} (perplexity {a['perplexity']:.3f}): logits SQNR {a['sqnr_db']:.1f} dB, "
            f"KL {a['kl_div']:.2e}, top-1 agreement {a['top1_agreement']:.1%} over {a['positions']} positions"
        )
    return "\n".join(lines)
