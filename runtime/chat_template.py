"""Chat templates, rendered as transformers renders them, in a sandboxed worker process.

    templates = ChatTemplates({"default": source}, {"bos_token": "<s>", ...}, where="build/x/tokenizer")
    text = templates.render(messages, tools=None, documents=None, add_generation_prompt=True,
                            kwargs={"enable_thinking": False})

The environment is transformers' own (`transformers.utils.chat_template_utils`, rebuilt here
because the runtime never imports transformers): jinja2's ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension and a no-op `{% generation %}` block,
`tojson` without ASCII escaping, `raise_exception`, `strftime_now`, and its restricted `dict`
and `namespace`. A template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and the caller's extra keywords.

A template comes from the artifact, so it is untrusted code for the sandbox to run. Rendering
happens in a child process (this file run as a script: the standard library and jinja2 only),
one render at a time, under limits a template cannot lift:

- time: RENDER_BUDGET_S per render (LOAD_BUDGET_S for compiling and the probe render at load);
  past it the process is killed, which stops the CPU it burns, and the next render starts a
  fresh one;
- memory: RLIMIT_AS of MEMORY_LIMIT_BYTES on the child; repeating a string or list past
  MAX_OUTPUT_CHARS is refused before it is built;
- output: at most MAX_OUTPUT_CHARS characters;
- recursion: RECURSION_LIMIT Python frames (a recursive macro ends there).

Every failure is a UserError naming the template: a template error (raise_exception, a bad
expression, a sandbox refusal) or a limit.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

RENDER_BUDGET_S = 0.5
LOAD_BUDGET_S = 10.0
MEMORY_LIMIT_BYTES = 1 << 30
MAX_OUTPUT_CHARS = 4 << 20
RECURSION_LIMIT = 400
MAX_POWER_BITS = 1 << 16  # `a ** b` larger than this many bits is refused (`10 ** 10 ** 10`)
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the tokenizer's named special tokens a template sees
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# the conversation every template must render at load
PROBE = [{"role": "user", "content": "Hello"}]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# -- the environment (child side) ------------------------------------------------------------------
def make_environment():
    """transformers' chat-template environment (its `_cached_compile_jinja_template`), with
    size checks on `*` and `**`."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it
        (for its assistant-token masks); rendering shows the body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if (
                        isinstance(seq, (str, list, tuple))
                        and isinstance(times, int)
                        and len(seq) * times > MAX_OUTPUT_CHARS
                    ):
                        raise jinja2.exceptions.TemplateError(
                            f"repeating a sequence of {len(seq)} {times} times is over the output limit"
                        )
            if (
                operator == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and abs(left) > 1
                and right * abs(left).bit_length() > MAX_POWER_BITS
            ):
                raise jinja2.exceptions.TemplateError(f"{left} ** {right} is too large")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict(...)` without a way to reach the dict type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
                )

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def template_messages(messages: list) -> list:
    """The messages as transformers hands them to a template: keys whose value is None dropped
    (`_normalize_chat_messages`), the reasoning text under each of its names
    (`_alias_reasoning_fields`)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _error(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return f"nested too deeply (over {RECURSION_LIMIT} levels)"
    if isinstance(e, MemoryError):
        return f"over the memory limit ({MEMORY_LIMIT_BYTES >> 20} MiB)"
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _worker() -> None:
    """The child: compile the templates it is sent, then render on request. Messages both ways
    are a 4-byte length and a JSON object."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):  # no such limit here: time and size limits still hold
        pass
    sys.setrecursionlimit(RECURSION_LIMIT)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    env, compiled = make_environment(), {}
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            return
        try:
            msg = json.loads(stdin.read(struct.unpack("<I", head)[0]))
            if msg["op"] == "load":
                for name, source in msg["templates"].items():
                    try:
                        compiled[name] = env.from_string(source)
                    except BaseException as e:
                        raise ValueError(f"template {name!r}: {_error(e)}") from None
                reply: dict[str, object] = {"ok": True}
            else:
                text = compiled[msg["template"]].render(**msg["context"])
                if len(text) > MAX_OUTPUT_CHARS:
                    raise ValueError(f"its output is over {MAX_OUTPUT_CHARS} characters")
                reply = {"text": text}
        except BaseException as e:  # the template's failure is the reply; the worker goes on
            reply = {"error": _error(e), "fatal": isinstance(e, MemoryError)}
        data = json.dumps(reply).encode()
        stdout.write(struct.pack("<I", len(data)) + data)
        stdout.flush()
        if reply.get("fatal"):
            return


# -- the renderer (parent side) ----------------------------------------------------------------------
class ChatTemplates:
    """The artifact's chat templates (name -> source; "default" is the one used unless another
    is asked for, or "tool_use" when tools are given), rendered in a worker process. `where`
    names them in errors (the artifact's file). Compiles them and renders PROBE at once: a
    template that fails there is refused (UserError)."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str], where: str):
        from dsc.errors import UserError

        self.templates, self.special_tokens, self.where = dict(templates), dict(special_tokens), where
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        if not self.templates:
            raise UserError(f"{where}: no chat template")
        with self._lock:
            reply = self._exchange({"op": "load", "templates": self.templates}, LOAD_BUDGET_S, "compiling")
        if "error" in reply:
            self.close()
            raise UserError(f"{where}: chat template refused at load: {reply['error']}")
        for name in self.templates:
            try:
                reply = self._render(name, self._context(PROBE, None, None, True, {}), LOAD_BUDGET_S)
            except UserError as e:
                reply = {"error": str(e)}
            if "error" in reply:
                self.close()
                raise UserError(
                    f"{where}: chat template {name!r} refused at load: it fails on the probe "
                    f"conversation {json.dumps(PROBE)}: {reply['error']}"
                )

    def pick(self, template: str | None, tools) -> str:
        from dsc.errors import UserError

        if template is not None:
            if template not in self.templates:
                raise UserError(
                    f"chat_template: {template!r} is not one of the artifact's chat templates "
                    f"({', '.join(sorted(self.templates))})"
                )
            return template
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise UserError(
            f"{self.where}: several chat templates and none is the default "
            f"({', '.join(sorted(self.templates))}); name one"
        )

    def render(
        self,
        messages: list,
        *,
        tools: list | None = None,
        documents: list | None = None,
        add_generation_prompt: bool = True,
        kwargs: dict | None = None,
        template: str | None = None,
        budget_s: float = RENDER_BUDGET_S,
    ) -> str:
        from dsc.errors import UserError

        name = self.pick(template, tools)
        kwargs = dict(kwargs or {})
        for key in RESERVED:
            if key in kwargs:
                raise UserError(f"chat_template_kwargs: {key!r} is set by the request itself")
        reply = self._render(name, self._context(messages, tools, documents, add_generation_prompt, kwargs), budget_s)
        if "error" in reply:
            raise UserError(f"chat template {name!r} ({self.where}): {reply['error']}")
        return reply["text"]

    def _context(self, messages, tools, documents, add_generation_prompt, kwargs) -> dict:
        return {
            **self.special_tokens,
            **kwargs,
            "messages": template_messages(messages),
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": bool(add_generation_prompt),
        }

    def _render(self, name: str, context: dict, budget_s: float) -> dict:
        from dsc.errors import UserError

        msg = {"op": "render", "template": name, "context": context}
        try:
            json.dumps(msg)
        except (TypeError, ValueError) as e:
            raise UserError(f"messages: a chat template takes JSON values only ({e})") from None
        with self._lock:
            return self._exchange(msg, budget_s, "rendering")

    # -- the worker -------------------------------------------------------------------------------
    def _spawn(self) -> None:
        import subprocess

        # -I: the child sees no PYTHON* variables, no user site and not the working directory
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )

    def _exchange(self, msg: dict, budget_s: float, doing: str) -> dict:
        """Send msg, wait up to budget_s for the reply ({"error": why} past it: the worker is
        killed). The caller holds the lock."""
        import time

        from dsc.errors import UserError

        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
            if msg["op"] != "load":  # a fresh worker compiles the templates first
                reply = self._exchange({"op": "load", "templates": self.templates}, LOAD_BUDGET_S, "compiling")
                if "error" in reply:
                    raise UserError(f"{self.where}: chat template: {reply['error']}")
        data = json.dumps(msg).encode()
        deadline = time.monotonic() + budget_s
        proc = self._proc
        # _spawn started it with pipes, and a load that killed it raised above
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(struct.pack("<I", len(data)) + data)
            proc.stdin.flush()
            head = self._read(4, deadline)
            reply = json.loads(self._read(struct.unpack("<I", head)[0], deadline))
        except TimeoutError:
            self._kill()
            return {"error": f"{doing} took over {budget_s:g} s, the template's time budget"}
        except (OSError, ValueError, struct.error):  # the worker died (a limit it hit outside Python)
            self._kill()
            return {"error": f"its worker died while {doing} (a memory or recursion limit)"}
        if reply.get("fatal"):
            self._kill()
        return reply

    def _read(self, n: int, deadline: float) -> bytes:
        import select
        import time

        assert self._proc is not None and self._proc.stdout is not None  # the caller's worker, started with pipes
        fd, out = self._proc.stdout.fileno(), b""
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise OSError("the worker closed its output")
            out += chunk
        return out

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()

    def close(self) -> None:
        """Stop the worker (a later render starts another)."""
        with self._lock:
            self._kill()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # at interpreter exit the modules may be gone; the child exits on EOF
            pass


if __name__ == "__main__":
    _worker()
