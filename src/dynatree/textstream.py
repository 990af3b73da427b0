"""Committed token groups -> text deltas, with stop strings cut out and incomplete text held back;
one token's own text and bytes (for log-probability listings)."""

from __future__ import annotations

import functools
import re

from transformers.convert_slow_tokenizer import bytes_to_unicode


class TextStream:
    """Turns the tokens a decode commits into the text a client may already see.

    Text is decoded from all ids so far (a token's text can depend on its neighbours). Held back:
    a trailing incomplete UTF-8 sequence (decoded as U+FFFD), and a tail that could be the start
    of a stop string. When a stop string appears, the text ends just before it (OpenAI's rule: the
    stop text is not returned) and `stopped` is set.
    """

    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped = False
        self.stop_at: int | None = None  # with `stopped`: how many tokens it took to complete the stop string
        self.text: str | None = None  # with `stopped`: the whole text, up to just before the stop string
        self._decoded = 0  # length of the text of every id, as the last push or finish decoded it
        self._shown = 0  # tokens known to have their whole text handed out (`shown()`)

    def push(self, ids: list[int]) -> str:
        """Add committed tokens; the new text that may be sent now ('' if none)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self.stop_at = self._tokens_to_stop(len(self.ids) - len(ids))
            self.text = text[:cut]
            return self._take(self.text)
        self._decoded = len(text)
        text = text.rstrip("\ufffd")  # an incomplete character at the end waits; the text before it goes
        return self._take(text[: len(text) - self._held(text)])

    def finish(self) -> str:
        """The text still held back once the decode has ended (no stop string came)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self._decoded = len(text)
        return self._take(text)

    def shown(self) -> int:
        """How many of `ids` have their whole text handed out (for their logprobs): the most tokens whose
        decoded text fits in what was sent. A token holding part of a character or a possible start of a
        stop string waits for the text that shows it; once stopped, the stop string's own tokens never
        count. Computed when asked (only logprobs need it), without a decode unless text is held back."""
        if not self.stopped and self._decoded <= self.sent:  # nothing held back (the usual case)
            self._shown = len(self.ids)
            return self._shown
        for n in range((self.stop_at if self.stopped else len(self.ids)) - 1, self._shown, -1):
            if len(self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)) <= self.sent:
                self._shown = n
                break
        return self._shown

    def _take(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def _first_stop(self, text: str) -> int | None:
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))  # a stop may straddle what was sent
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _tokens_to_stop(self, before: int) -> int:
        """The fewest tokens (at least `before`, the ones that held no stop) whose text holds a stop."""
        for n in range(before + 1, len(self.ids)):
            if self._first_stop(self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)) is not None:
                return n
        return len(self.ids)

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return n
        return 0


class TokenTexts:
    """Each token's own text, as it reads after other text (a SentencePiece token's leading space
    kept, which decoding it alone drops), and its UTF-8 bytes: a token holding part of a character
    (its text reads U+FFFD) gives its own bytes where the tokenizer says them (byte-level BPE
    symbols, `<0xHH>` byte tokens), else None. For log-probability listings."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]  # decoded before each token, then cut off
        self.prefix = tokenizer.decode(self.anchor)
        self.byte_level = _byte_level(tokenizer)
        self._known: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        if token not in self._known:
            self._known[token] = self._text(token)
        return self._known[token]

    def _text(self, token: int) -> tuple[str, list[int] | None]:
        after = self.tokenizer.decode(self.anchor + [token])
        text = after[len(self.prefix):] if after.startswith(self.prefix) else self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        symbol = self.tokenizer.convert_ids_to_tokens(token)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", symbol)
        if byte:
            return text, [int(byte.group(1), 16)]
        decoder = _byte_decoder()
        if self.byte_level and all(c in decoder for c in symbol):
            return text, [decoder[c] for c in symbol]
        return text, None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level(tokenizer) -> bool:
    """The tokenizer's symbols are GPT-2's byte-level alphabet (a ByteLevel decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"
