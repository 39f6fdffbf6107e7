"""Text as tokens arrive: incremental detokenization and stop strings, for streamed responses.

``Detokenizer.add(id)`` returns the text that token completes. It decodes a short window of recent ids, not the
whole output (text-generation-inference's method): the text of ``ids[prefix:]`` minus that of ``ids[prefix:read]``.
A token that ends inside a multi-byte character (the text ends in U+FFFD) gives nothing until the character is
whole. ``StopMatcher.feed(text)`` holds back the end of the text that could begin a stop string, and cuts the text
before the first stop string found.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already (kept as context for the next piece)
        self.read = 0

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """What the last tokens decode to even if incomplete (the end of the output)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class StopMatcher:
    def __init__(self, stops=()):
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything fed
        self.sent = 0  # characters of it given out
        self.done = False

    def feed(self, piece: str) -> tuple[str, bool]:
        """-> (text safe to send now, whether a stop string was found: the text then ends before it)."""
        if self.done:
            return "", True
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        # a stop string starts in the unsent text: every end of the sent text that could begin one was held back
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.sent:end]
            self.sent, self.done = end, True
            return out, True
        hold = 0  # the longest end of the text that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self, piece: str = "") -> str:
        """The end of the output: what was held back (and ``piece``), unless a stop string ended it."""
        if self.done:
            return ""
        out, _ = self.feed(piece)
        if self.done:
            return out
        out += self.text[self.sent:]
        self.sent = len(self.text)
        self.done = True
        return out
