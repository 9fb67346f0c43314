"""Incremental detokenization with stop strings, for the router's replies.

Text is only released once it can no longer change: a trailing partial UTF-8 character (the
byte-level BPE decodes it as U+FFFD) and any tail that could still become a stop string are held
back until the next tokens or the end.
"""
from __future__ import annotations

from baton.shared.model.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already released
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Feed new tokens; returns the tokens to report and the newly releasable text. After a
        stop string matched, `stopped` is True and later tokens are dropped."""
        if self.stopped:
            return [], ""
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(self.tokens)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return token_ids, self._release(text[:cut])
        return token_ids, self._release(text[:len(text) - self._holdback(text)])

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        return "" if self.stopped else self._release(self.tokenizer.decode(self.tokens))

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens)

    def _release(self, upto: str) -> str:
        delta = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return delta

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = 1 if text.endswith(REPLACEMENT) else 0
        for s in self.stop:
            for n in range(len(s) - 1, 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
