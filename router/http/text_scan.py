"""Finding a tag in text that arrives in pieces (a stream's deltas).

What may be the start of the tag is held back until the next piece tells;
the rest is released at once, so a streamed answer never shows half a tag
and never waits longer than the tag is long.
"""

from __future__ import annotations


def held_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TagScanner:
    """Text in pieces -> (text before the tag, True) once the tag shows, the
    text after it kept for the caller (``rest``); (safe text, False) before."""

    __slots__ = ("buf", "rest", "tag")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.buf = ""
        self.rest = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.buf + text
        i = buf.find(self.tag)
        if i >= 0:
            self.buf = ""
            self.rest = buf[i + len(self.tag) :]
            return buf[:i], True
        keep = held_suffix(buf, self.tag)
        self.buf = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
