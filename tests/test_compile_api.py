"""`dsc.compile` of a loaded transformers model with its tokenizer (`tokenizer=`)."""

from __future__ import annotations

import json

import pytest
import torch

import dsc
from dsc.errors import UserError


def test_a_loaded_model_with_its_tokenizer_gets_a_tokenizer_folder(tmp_path, make_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = make_checkpoint("llama-tiny")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    art = dsc.compile(model, tmp_path / "art", tokenizer=tok, max_seq=64)
    files = json.loads((art / "manifest.json").read_text())["files"]
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(files)
    # the same files a checkpoint folder's compile copies, written by the tokenizer itself
    saved = tmp_path / "saved"
    tok.save_pretrained(saved)
    assert (art / "tokenizer" / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()
    llm = dsc.LLM(art, device="cpu")
    text = "Hello world, the tokenizer came along"
    assert llm.get_tokenizer().encode(text).ids == tok(text)["input_ids"]
    out = llm.generate([text], dsc.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out.text == tok.decode(out.token_ids) and len(out.token_ids) == 5


def test_tokenizer_argument_bad_input_is_one_line(tmp_path, make_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = make_checkpoint("llama-tiny")
    tok = AutoTokenizer.from_pretrained(ckpt)
    with pytest.raises(UserError, match="tokenizer= is for a loaded model"):
        dsc.compile(str(ckpt), tmp_path / "a", tokenizer=tok)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with pytest.raises(UserError, match="expects a transformers tokenizer"):
        dsc.compile(model, tmp_path / "b", tokenizer="gpt2")
    tok.add_tokens([f"<extra_{i}>" for i in range(model.config.vocab_size)])  # more ids than the embedding
    with pytest.raises(UserError, match="more than the model's vocab_size 512"):
        dsc.compile(model, tmp_path / "c", tokenizer=tok)
    assert not any((tmp_path / n).exists() for n in "abc")
