"""Reasoning parsers (``--reasoning-parser``): a model's thinking split from its answer.

``qwen3`` (also DeepSeek-R1's format): an output that opens with ``<think>``
thinks until ``</think>``; that part is ``reasoning_content``, the rest the
answer (``content``). An output that does not open with ``<think>`` is all
answer (Qwen3 with ``enable_thinking: false``). A thought cut short by
``max_tokens`` stays reasoning. Streamed and whole answers split the same
way: the whole one is the stream's pieces joined.
"""

from __future__ import annotations

import enum

from router.http.text_scan import TagScanner

REASONING_PARSERS = ("qwen3", "deepseek_r1")
_OPEN, _CLOSE = "<think>", "</think>"


class _Phase(enum.Enum):
    START = "start"  # not yet known whether the output opens with <think>
    THINKING = "thinking"
    ANSWER = "answer"


class ReasoningSplitter:
    """Output text in pieces -> ("reasoning" | "content", text) pieces."""

    __slots__ = ("close", "head", "phase")

    def __init__(self) -> None:
        self.phase = _Phase.START
        self.head = ""
        self.close = TagScanner(_CLOSE)

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.phase is _Phase.ANSWER:
            return [("content", text)] if text else []
        if self.phase is _Phase.THINKING:
            return self._thinking(text)
        self.head += text
        stripped = self.head.lstrip()
        if stripped.startswith(_OPEN):
            self.phase = _Phase.THINKING
            return self._thinking(stripped[len(_OPEN) :])
        if _OPEN.startswith(stripped):
            return []  # it may still open with <think>
        self.phase = _Phase.ANSWER
        return [("content", self.head)]

    def _thinking(self, text: str) -> list[tuple[str, str]]:
        before, closed = self.close.feed(text)
        out = [("reasoning", before)] if before else []
        if closed:
            self.phase = _Phase.ANSWER
            if self.close.rest:
                out.append(("content", self.close.rest))
        return out

    def finish(self) -> list[tuple[str, str]]:
        if self.phase is _Phase.START:
            self.phase = _Phase.ANSWER
            return [("content", self.head)] if self.head else []
        if self.phase is _Phase.THINKING:
            rest = self.close.flush()
            return [("reasoning", rest)] if rest else []
        return []
