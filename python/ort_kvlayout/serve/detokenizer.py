"""A request's text as its tokens come: incremental detokenization and stop strings.

    text = IncrementalText(tokenizer, prompt_len=len(prompt), stops=("\\n\\n",))
    delta, hit = text.delta(seq, final=False)   # after each new token of seq (prompt + output)

Pure Python over a tokenizer's `decode`; no engine state, so it is tested alone.
"""

from __future__ import annotations

__all__ = ["IncrementalText"]

_CONTEXT = 4  # tokens decoded before the new ones, so a word's leading space comes out right


class IncrementalText:
    """The generated text of one request, decoded incrementally (vLLM's scheme): the tokens
    since the last complete text are decoded with a few tokens of context before them, and the
    part past the context's own text is appended, so a step decodes a handful of tokens, not
    the whole output, and a word's leading space or a multi-byte character split over tokens
    comes out as the full decode has it. Until `final`, text ending in an incomplete UTF-8
    character waits for the next token. Stop strings: the text sent ends before the first one,
    and a suffix that may begin one is held back until it cannot."""

    def __init__(self, tokenizer, prompt_len: int, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.stops = stops
        self.text = ""  # generated text decoded so far
        self.emitted = 0  # characters of it already sent
        self._prefix = max(prompt_len - _CONTEXT, 0)  # seq[_prefix:_read]: the next context
        self._read = prompt_len

    def _decoded(self, seq: list[int], end: int, final: bool) -> str:
        if self._read >= end:
            return self.text
        decode = self.tokenizer.decode
        prefix = decode(seq[self._prefix : self._read])
        full = decode(seq[self._prefix : end])
        if not full.startswith(prefix):  # a tokenizer whose decode is not incremental
            self.text = decode(seq[self.prompt_len : end])
            self._prefix = self._read = end
        elif final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix, self._read = self._read, end
        return self.text

    def delta(self, seq: list[int], final: bool, upto: int | None = None) -> tuple[str, bool]:
        """The new text to send after seq[:upto] (default: all of seq), and whether a stop
        string was found (the text then ends before it). `upto` lets a caller that grew seq
        since ask for the text as of an earlier token (the engine hands events over after the
        next step's calls started); the calls come in order of `upto`."""
        text = self._decoded(seq, len(seq) if upto is None else upto, final)
        stops = self.stops
        if stops:
            lo = max(0, self.emitted - max(len(s) for s in stops))
            hits = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
            if hits:
                end = max(min(hits), self.emitted)
                delta = text[self.emitted : end]
                self.emitted = end
                return delta, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in stops:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end = min(end, len(text[:end]) - k)
                        break
        end = max(end, self.emitted)
        delta = text[self.emitted : end]
        self.emitted = end
        return delta, False
