"""Incremental detokenization of a generated sequence, with stop strings.

Decoding every step's whole output is quadratic, and decoding each token alone is wrong: byte-level
BPE splits a multi-byte character over several tokens, and SentencePiece decoders drop or keep a
leading space depending on what comes before. So the text is read through a small window of
trailing tokens (vLLM's and TGI's prefix offset / read offset):

    ids:   ... prompt tail ... | generated ...
           ^ prefix            ^ read
    new text = decode(ids[prefix:]) minus decode(ids[prefix:read])

and the offsets move up only when the decoded window does not end in U+FFFD, the replacement
character of an incomplete UTF-8 sequence, which the next token may complete.
"""

from __future__ import annotations

from collections.abc import Sequence

_PARTIAL = "\ufffd"
_CONTEXT = 5  # prompt tokens decoded ahead of the first generated one, for its leading space


class Detokenizer:
    """d = Detokenizer(tokenizer, prompt_ids, stop=["\\n\\n"]); piece = d.add([token]) per step.

    `add` returns the new stable text: never a trailing partial character, and never text that
    might be the start of a stop string (held back until it is clear). Once a stop string shows,
    the text ends before it (after it with include_stop), `stopped` is set and `stop_reason`
    names it. When the sequence ends for another reason (eos, max tokens), `flush()` returns
    what was held back. `text` is everything returned so far: in the end the text the generated
    tokens add to the prompt's (with byte-level BPE, exactly tokenizer.decode(generated ids); with
    SentencePiece-style decoders a first word keeps the space a lone decode would drop).
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None
        self._ids = list(prompt_ids)
        self._read = len(self._ids)
        self._prefix = max(self._read - _CONTEXT, 0)
        self._stable = ""  # the generated text decoded so far, up to the read offset
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _read_new(self, final: bool) -> None:
        """Extend the stable text with what the tokens past the read offset decode to, unless
        that ends in a partial character (kept too when `final`)."""
        window = self._decode(self._ids[self._prefix :])
        if window.endswith(_PARTIAL) and not final:
            return
        self._stable += window[len(self._decode(self._ids[self._prefix : self._read])) :]
        self._prefix, self._read = self._read, len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that became stable ("" once stopped)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The sequence ended without a stop string: the text held back, a trailing partial
        character included (as U+FFFD, as a full decode shows it)."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        self._read_new(final)
        # held-back text is shorter than the longest stop string, and no stop string can start
        # in text already returned (it would have been held back): the search starts there
        hit = self._find_stop(len(self.text))
        if hit is not None:
            at, s = hit
            self.stopped, self.stop_reason = True, s
            return self._emit(at + len(s) if self.include_stop else at)
        return self._emit(len(self._stable) if final else len(self._stable) - self._held_for_stop())

    def _emit(self, end: int) -> str:
        piece = self._stable[len(self.text) : end]
        self.text += piece
        return piece

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The stop string occurrence at or after `start` that ends first (of two ending at the
        same place, the longer): the one a token-by-token stream completes first, so the cut
        does not depend on how tokens were grouped into add() calls."""
        found = [(at + len(s), at, s) for s in self.stop if (at := self._stable.find(s, start)) >= 0]
        if not found:
            return None
        _, at, s = min(found)
        return at, s

    def _held_for_stop(self) -> int:
        """How many trailing characters of the stable text could begin a stop string."""
        text = self._stable
        for n in range(min(self._longest_stop - 1, len(text) - len(self.text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
