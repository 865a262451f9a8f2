"""`make demo`: the whole dsc loop on a small random-weight Llama-style model.

1. write a checkpoint ("llama-demo" shape: GQA, RoPE, RMSNorm, SwiGLU; random weights; a
   real byte-level BPE tokenizer) to build/demo/llama-demo
2. `dsc compile build/demo/llama-demo -o build/demo/llama-demo.dsc --dtype fp32 --verify`
3. `dsc generate build/demo/llama-demo.dsc --prompt ...`
4. run transformers on the same prompt and print whether its greedy tokens are the same

The weights are random, so the text is gibberish; the point is that it is the same gibberish.

    python scripts/demo.py                  # what `make demo` runs
    python scripts/demo.py --out DIR        # the same, its files under DIR instead of build/demo
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "demo"
PROMPT = "The quick brown fox"
NEW_TOKENS = 16


def dsc(*args: str) -> str:
    """Run the dsc CLI as a user would; echo the command; return its stdout."""
    print(f"\n$ dsc {shlex.join(args)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsc", *args], stdout=subprocess.PIPE, text=True)
    print(r.stdout, end="")
    if r.returncode:
        sys.exit(f"demo: `dsc {args[0]}` failed with exit code {r.returncode}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return r.stdout


def transformers_greedy(ckpt: Path, prompt_ids: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=model.config.eos_token_id)  # stops at eos, as dsc does
    return out[0, len(prompt_ids):].tolist()


def main() -> None:
    from tokenizers import Tokenizer

    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where the checkpoint and artifact go")
    out_dir = ap.parse_args().out.resolve()
    ckpt, art = out_dir / "llama-demo", out_dir / "llama-demo.dsc"
    shutil.rmtree(ckpt, ignore_errors=True)
    rel = lambda p: str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)  # noqa: E731
    print(f"writing a random-weight llama-demo checkpoint to {rel(ckpt)}")
    make_random_checkpoint(ckpt, "llama-demo", dtype="float32")
    cfg = json.loads((ckpt / "config.json").read_text())
    print(f"  {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads "
          f"/ {cfg['num_key_value_heads']} kv heads, vocab {cfg['vocab_size']}")

    dsc("compile", rel(ckpt), "-o", rel(art), "--dtype", "fp32", "--verify")
    dsc("inspect", rel(art))
    out = dsc("generate", rel(art), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json")
    got = json.loads(out.strip().splitlines()[-1])["tokens"]

    prompt_ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(PROMPT).ids
    want = transformers_greedy(ckpt, prompt_ids)
    print(f"\ntransformers greedy: {want}\ndsc greedy:          {got}")
    if got != want:
        sys.exit("demo: FAILED, dsc and transformers disagree")
    print(f"check against transformers: the same {len(got)} tokens, token for token")


if __name__ == "__main__":
    main()
