"""Chat templates: dsc's sandboxed renderer (runtime/chat_template.py) against transformers' own
on real templates over the same conversations, strings compared exactly; the artifact carries
the checkpoint's chat_template.jinja and additional_chat_templates/; the renderer's limits.

tests/data/chat_templates holds the Hub templates of Llama 3.1 and 3.2 Instruct, Qwen2.5
Instruct, Qwen3 (enable_thinking), Gemma 2 and 3, Mistral 7B Instruct v0.3, Phi-3 mini and
SmolLM2 Instruct, and one template for the environment's remaining parts (loop controls,
{% generation %}, dict, tojson's keywords).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from dsc.errors import UserError
from dsc.runtime import chat_template as ct
from dsc.runtime.chat_template import ChatTemplates

DATA = Path(__file__).parent / "data" / "chat_templates"
TEMPLATES = sorted(p.name for p in DATA.glob("*.jinja"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, now",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "city": {"type": "string", "description": "the city, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
            },
        },
    }
]
_TOOL_TURNS = [
    {"role": "user", "content": "What's the weather in Zürich?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call12345",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call12345", "content": '{"temperature": 21, "sky": "clear"}'},
]
_MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "  Hello.  "},
    {"role": "user", "content": "Count to three."},
]
CONVERSATIONS = {
    "one-turn": ([{"role": "user", "content": "Hello, who are you?"}], None, {}),
    "system-multi-turn": (_MULTI, None, {}),
    "no-system-multi-turn": (_MULTI[1:], None, {}),
    "unicode": ([{"role": "user", "content": 'Grüße, 世界 🙂 <b>&amp;</b> "quoted"\n  and spaces  '}], None, {}),
    "tools": (_TOOL_TURNS, TOOLS, {}),
    "tools-first-turn": (_TOOL_TURNS[:1], TOOLS, {}),
    "thinking-off": (_MULTI[1:], None, {"enable_thinking": False}),
    "reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"},
            {"role": "user", "content": "and 3+3?"},
        ],
        None,
        {"enable_thinking": True},
    ),
    "max-turns": (_MULTI, TOOLS, {"max_turns": 1, "date_string": "01 Jan 2030"}),
}


def _transformers(source: str, messages, tools, kwargs, add_generation_prompt: bool):
    """(text, None) or (None, error) from transformers' own renderer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        out, _ = render_jinja_template(
            [json.loads(json.dumps(messages))],
            tools=tools,
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            **SPECIAL,
            **kwargs,
        )
        return out[0], None
    except Exception as e:  # noqa: BLE001 (whatever the template raised: dsc must refuse it too)
        return None, str(e)


@pytest.fixture(scope="module")
def renderers():
    made = {name: ChatTemplates({"default": (DATA / name).read_text()}, SPECIAL, name) for name in TEMPLATES}
    yield made
    for r in made.values():
        r.close()


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_renders_as_transformers_does(renderers, name, add_generation_prompt):
    source = (DATA / name).read_text()
    rendered = 0
    for conv, (messages, tools, kwargs) in CONVERSATIONS.items():
        expect, error = _transformers(source, messages, tools, kwargs, add_generation_prompt)
        try:
            got = renderers[name].render(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs
            )
        except UserError as e:
            assert error is not None, f"{name} / {conv}: dsc refused what transformers renders: {e}"
            assert error in str(e) and name in str(e), (conv, error, str(e))
            continue
        assert error is None, f"{name} / {conv}: transformers raised {error!r}, dsc rendered {got!r}"
        assert got == expect, f"{name} / {conv}"
        rendered += 1
    assert rendered >= 3, f"{name}: rendered only {rendered} of the conversations"


def test_the_environment_is_transformers_own():
    """Each global and filter transformers adds, and the sandbox, behave the same."""
    cases = {
        "tojson": (
            "{{ {'k': 'é<&>', 'n': [1, 2.5, none, true]} | tojson }}",
            '{"k": "é<&>", "n": [1, 2.5, null, true]}',
        ),
        "tojson-indent": ("{{ {'b': 1, 'a': [1]} | tojson(indent=2, sort_keys=true) }}", None),
        "strftime": ("{{ strftime_now('%Y') }}", time.strftime("%Y")),
        "loopcontrols": (
            "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
            "{% if i > 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            "023",
        ),
        "trim-lstrip": ("  {% if true %}\n  x\n  {% endif %}\ny", "  x\ny"),
        "generation": ("{% generation %}abc{% endgeneration %}", "abc"),
        "namespace": ("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}", "2"),
        "dict": ("{{ dict(a=1).items() | list }}", "[('a', 1)]"),
    }
    r = ChatTemplates({k: v for k, (v, _) in cases.items()} | {"default": "x"}, SPECIAL, "cases")
    try:
        for name, (source, want) in cases.items():
            expect, error = _transformers(source, [], None, {}, False)
            assert error is None, (name, error)
            got = r.render([{"role": "user", "content": "x"}], template=name)
            assert got == expect and (want is None or got == want), (name, got, expect)
        # the sandbox: what transformers refuses, dsc refuses; what it renders harmless, dsc does too
        for source, refused in (
            ("{{ ''.__class__ }}", False),
            ("{{ messages.append(1) }}", True),
            ("{% set ns = namespace(_x=1) %}", True),
            ("{{ raise_exception('no') }}", True),
        ):
            messages = [{"role": "user", "content": "go"}]
            expect, error = _transformers(source, messages, None, {}, False)
            assert (error is not None) == refused, (source, error)
            bad = ChatTemplates(
                {"default": "{% if messages[0].content == 'go' %}" + source + "{% endif %}"}, SPECIAL, "bad"
            )
            try:
                if refused:
                    with pytest.raises(UserError):
                        bad.render(messages)
                else:
                    assert bad.render(messages) == expect
            finally:
                bad.close()
    finally:
        r.close()


# -- limits -------------------------------------------------------------------------------------------
def _hostile(body: str) -> ChatTemplates:
    """A template that passes the probe at load and runs `body` on a user message 'go'."""
    return ChatTemplates(
        {
            "default": "{% for m in messages %}{% if m.content == 'go' %}"
            + body
            + "{% endif %}{{ m.content }}{% endfor %}"
        },
        {},
        "hostile.jinja",
    )


@pytest.mark.parametrize(
    "body, why",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time budget"),
        ("{{ range(10**9) | list }}", "Range too big"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested too deeply"),
        ("{% set x = 'a' * 200000000 %}", "over the output limit"),
        ("{% set x = 7 ** 1000000000 %}", "too large"),
        ("{{ 'x' | center(1500000000) }}", "memory limit"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters"),
    ],
    ids=["nested-loops", "range", "div0", "recursion", "repeat", "power", "memory", "output"],
)
def test_hostile_templates_are_one_line_and_the_worker_survives(body, why):
    r = _hostile(body)
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=why) as e:
            r.render([{"role": "user", "content": "go"}])
        assert time.monotonic() - t0 < ct.RENDER_BUDGET_S + 1.5 and "\n" not in str(e.value)
        assert "hostile.jinja" in str(e.value)
        assert r.render([{"role": "user", "content": "fine"}]) == "fine"  # a fresh worker when it had to die
    finally:
        r.close()


def test_a_runaway_render_is_killed_not_left_burning_cpu():
    r = _hostile("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    try:
        proc = r._proc
        with pytest.raises(UserError, match="time budget"):
            r.render([{"role": "user", "content": "go"}])
        assert proc.poll() is not None  # the process that ran it is gone
    finally:
        r.close()


@pytest.mark.parametrize(
    "source, why",
    [
        ("{{ raise_exception('this template needs a system message') }}", "needs a system message"),
        ("{% for m in messages %}{{ m.content", "TemplateSyntaxError"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time budget"),
    ],
    ids=["raises", "syntax", "spins"],
)
def test_a_template_that_fails_the_probe_is_refused_at_load(source, why, monkeypatch):
    monkeypatch.setattr(ct, "LOAD_BUDGET_S", 1.0)
    with pytest.raises(UserError, match=why) as e:
        ChatTemplates({"default": source}, {}, "art/tokenizer/chat_template.jinja")
    assert str(e.value).startswith("art/tokenizer/chat_template.jinja: chat template") and "\n" not in str(e.value)


def test_reserved_and_unknown_names_are_refused(renderers):
    r = renderers["smollm2-instruct.jinja"]
    with pytest.raises(UserError, match="chat_template_kwargs: 'messages'"):
        r.render([{"role": "user", "content": "x"}], kwargs={"messages": []})
    with pytest.raises(UserError, match="chat_template: 'nope'"):
        r.render([{"role": "user", "content": "x"}], template="nope")


# -- through the artifact --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def templated(make_checkpoint, compile_artifact, tmp_path_factory):
    """(tokenizer folder, artifact): llama-tiny's tokenizer with Qwen3's template as
    chat_template.jinja and Llama 3.1's as additional_chat_templates/tool_use.jinja, as
    transformers saves them, and the compiled llama-tiny with those files in its tokenizer/
    (tests/test_compile.py checks that `dsc compile` copies them there)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from artifact_edits import copy_artifact, rehash

    root = tmp_path_factory.mktemp("templated")
    tok = root / "tokenizer"
    tok.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(make_checkpoint("llama-tiny") / f, tok / f)
    shutil.copy(DATA / "qwen3.jinja", tok / "chat_template.jinja")
    (tok / "additional_chat_templates").mkdir()
    shutil.copy(DATA / "llama-3.1-instruct.jinja", tok / "additional_chat_templates" / "tool_use.jinja")
    art = copy_artifact(compile_artifact("llama-tiny", dtype="fp32"), root / "artifact")
    shutil.rmtree(art / "tokenizer")
    shutil.copytree(tok, art / "tokenizer")
    rehash(art)
    return tok, art


def test_the_artifact_carries_the_templates_and_renders_as_the_tokenizer(templated):
    from transformers import AutoTokenizer

    from dsc.runtime.llm import LLM

    folder, art = templated
    tok = AutoTokenizer.from_pretrained(folder)
    llm = LLM(art, device="cpu")
    for messages, tools, kwargs in CONVERSATIONS.values():
        expect = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert llm.engine.apply_chat_template(messages, tools=tools, chat_template_kwargs=kwargs) == expect
    out = llm.chat(_MULTI[1:], chat_template_kwargs={"enable_thinking": False})
    prompt = tok.apply_chat_template(_MULTI[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert out[0].prompt_token_ids == llm.engine.encode(prompt) and out[0].outputs[0].token_ids


def test_tokenizer_config_templates_and_a_refused_one(templated, tmp_path):
    """Without chat_template.jinja the template is tokenizer_config.json's (a string or named
    list); one that fails its probe makes the load one line naming the file."""
    import sys

    from dsc.runtime.llm import LLMEngine

    sys.path.insert(0, str(Path(__file__).parent))
    from artifact_edits import copy_artifact, rehash

    _, art = templated
    phi3 = DATA.joinpath("phi-3-mini-instruct.jinja").read_text()
    for value, expect in (
        (phi3, "<|user|>\nHi<|end|>\n<|assistant|>\n"),
        ([{"name": "default", "template": "D{{ messages[0].content }}"}, {"name": "rag", "template": "R"}], "DHi"),
        ("{{ raise_exception('no probe for me') }}", None),
    ):
        a = copy_artifact(art, tmp_path / f"a{len(list(tmp_path.iterdir()))}")
        for f in ("chat_template.jinja", "additional_chat_templates/tool_use.jinja"):
            (a / "tokenizer" / f).unlink()
        (a / "tokenizer" / "additional_chat_templates").rmdir()
        cfg = json.loads((a / "tokenizer" / "tokenizer_config.json").read_text())
        (a / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": value}))
        rehash(a)
        if expect is None:
            with pytest.raises(UserError, match="tokenizer_config.json: chat template 'default' refused at load"):
                LLMEngine(a, device="cpu")
            continue
        eng = LLMEngine(a, device="cpu")
        assert eng.apply_chat_template([{"role": "user", "content": "Hi"}]) == expect
