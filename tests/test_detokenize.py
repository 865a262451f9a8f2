"""runtime/detokenize.py: incremental detokenization and stop strings, against full decodes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from dsc.compiler.random_checkpoint import make_tokenizer
from dsc.runtime.detokenize import Detokenizer

_TEXTS = ["Hello world! 你好，世界。", "emoji 🦊🐶 and 👩‍👩‍👧 family", "naïve café — ½ ∑ x²", "the quick brown fox"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out, 1000)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _stream(d: Detokenizer, ids: list[int], chunks: list[int]) -> str:
    """Feed ids in chunks of the given sizes (then one at a time), then flush."""
    out, i = [], 0
    for n in chunks:
        out.append(d.add(ids[i : i + n]))
        i += n
    out += [d.add([t]) for t in ids[i:]]
    out.append(d.flush())
    assert "".join(out) == d.text
    return d.text


def _expected_cut(text: str, stop: list[str], include_stop: bool) -> tuple[str, str | None]:
    found = [(at + len(s), at, s) for s in stop if s and (at := text.find(s)) >= 0]
    if not found:
        return text, None
    end, at, s = min(found)
    return text[: end if include_stop else at], s


ids_strategy = st.lists(st.integers(0, 999), max_size=25)
text_strategy = st.text(
    alphabet=st.sampled_from(list("ab \n.xyz") + list("你好🦊é½👩‍")), max_size=20
) | st.sampled_from(_TEXTS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=text_strategy,
    text=text_strategy,
    extra=ids_strategy,
    chunks=st.lists(st.integers(0, 4), max_size=6),
    skip=st.booleans(),
)
def test_streamed_text_equals_the_full_decode(tok, prompt, text, extra, chunks, skip):
    gen = tok.encode(text).ids + extra
    d = Detokenizer(tok, tok.encode(prompt).ids, skip_special_tokens=skip)
    assert _stream(d, gen, chunks) == tok.decode(gen, skip_special_tokens=skip)
    assert not d.stopped and d.stop_reason is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=text_strategy,
    text=text_strategy,
    extra=ids_strategy,
    chunks=st.lists(st.integers(0, 4), max_size=6),
    stop_spans=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4)), max_size=3),
    other_stop=st.lists(text_strategy, max_size=2),
    include_stop=st.booleans(),
)
def test_streamed_text_is_cut_at_the_first_stop_string(
    tok, prompt, text, extra, chunks, stop_spans, other_stop, include_stop
):
    gen = tok.encode(text).ids + extra
    full = tok.decode(gen)
    stop = [full[a : a + n] for a, n in stop_spans] + other_stop  # most occur in the text
    d = Detokenizer(tok, tok.encode(prompt).ids, stop=stop, include_stop=include_stop)
    want, reason = _expected_cut(full, stop, include_stop)
    assert _stream(d, gen, chunks) == want
    assert d.stopped == (reason is not None) and d.stop_reason == reason


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=ids_strategy, gen=ids_strategy)
def test_any_prompt_ids_stream_what_the_generation_adds_to_the_prompt_text(tok, prompt, gen):
    # prompts given as ids may end inside a character: where the prompt's text is still a
    # prefix of the whole text, the stream is exactly the rest
    d = Detokenizer(tok, prompt)
    out = _stream(d, gen, [])
    full, before = tok.decode(prompt + gen), tok.decode(prompt)
    if full.startswith(before):
        assert out == full[len(before) :]


def test_a_single_stop_string(tok):
    d = Detokenizer(tok, [], stop="fox")
    assert _stream(d, tok.encode("the quick brown fox jumps").ids, []) == "the quick brown "
    assert d.stop_reason == "fox"


def test_partial_character_is_held_back_until_complete(tok):
    ids = tok.encode("🦊").ids
    assert len(ids) == 4  # one token per byte: the fox is split over four tokens
    d = Detokenizer(tok, tok.encode("a fox: ").ids)
    assert [d.add([t]) for t in ids] == ["", "", "", "🦊"]
    assert d.text == "🦊"


def test_stop_string_prefix_is_held_back_until_clear(tok):
    d = Detokenizer(tok, [], stop=["\n\nUser:"])
    assert d.add(tok.encode("Hi").ids) == "Hi"
    assert d.add(tok.encode("\n").ids) == ""
    assert d.add(tok.encode("\n").ids) == ""
    assert d.add(tok.encode("Use").ids) == ""
    assert d.add(tok.encode("d it").ids) == "\n\nUsed it"  # not the stop string after all
    assert d.add(tok.encode("\n\nUser: more").ids) == ""
    assert d.stopped and d.stop_reason == "\n\nUser:" and d.text == "Hi\n\nUsed it"
    assert d.add(tok.encode("ignored").ids) == "" and d.flush() == ""


def test_include_stop_and_the_first_completed_stop_wins(tok):
    d = Detokenizer(tok, [], stop=["world peace", "wor"], include_stop=True)
    for t in tok.encode("hello world peace").ids:
        d.add([t])
    assert d.stop_reason == "wor" and d.text == "hello wor"


def test_trailing_partial_character_comes_out_on_flush(tok):
    ids = tok.encode("ok 你").ids[:-1]  # the last character cut short
    d = Detokenizer(tok, [])
    streamed = "".join(d.add([t]) for t in ids)
    assert streamed == "ok "
    assert d.flush() == tok.decode(ids)[3:] and d.text == tok.decode(ids)
    assert d.text.endswith("\ufffd")


def test_special_tokens(tok):
    eos = tok.token_to_id("</s>")
    ids = tok.encode("done").ids + [eos]
    for skip, want in ((True, "done"), (False, "done</s>")):
        d = Detokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(d.add([t]) for t in ids) + d.flush() == want


@pytest.fixture(scope="module")
def metaspace_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): "▁" marks a word's leading space, and
    decoding drops it at the start of the text."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world, hello there."] * 4, trainer)
    return tok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.sampled_from(["Hello", "the quick brown", "a b c d e f g"]),
    words=st.lists(st.sampled_from(["fox", "the", "lazy", "dog.", "hello", ","]), min_size=1, max_size=8),
)
def test_words_keep_their_leading_space_after_the_prompt(metaspace_tok, prompt, words):
    tok = metaspace_tok
    prompt_ids = tok.encode(prompt).ids
    gen = tok.encode(prompt + " " + " ".join(words)).ids[len(prompt_ids) :]
    d = Detokenizer(tok, prompt_ids)
    streamed = "".join(d.add([t]) for t in gen) + d.flush()
    assert streamed == tok.decode(prompt_ids + gen)[len(tok.decode(prompt_ids)) :]
    assert streamed.startswith(" ")  # decoding the new tokens alone would drop this space
