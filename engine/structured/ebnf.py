"""A syntax check of xgrammar's EBNF (GBNF-like) grammars, torch-free.

Rules are ``name ::= alternatives``; alternatives are sequences split by ``|``;
elements are "strings", [character classes], rule names, ( groups ), each
optionally followed by ``*``, ``+``, ``?`` or ``{m}``, ``{m,}``, ``{m,n}``; a
rule may end with a lookahead ``(= sequence)``; ``#`` starts a comment. A rule
runs until the next ``name ::=``. The grammar must define ``root``, define no
rule twice and reference only rules it defines. This checks the grammar's
form without compiling it (the router's check); built-in macros such as
``TagDispatch(...)`` are skipped over, their content left to the compiler.
"""

from __future__ import annotations

import re

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SPACE = re.compile(r"(?:\s|#[^\n]*)*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")
_STRING_ESCAPE = re.compile(
    r'\\(?:["\\/bfnrt\'\[\]-]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})'
)


class _Parser:
    def __init__(self, text: str, field: str) -> None:
        self.text = text
        self.field = field
        self.pos = 0
        self.defined: dict[str, int] = {}
        self.referenced: dict[str, int] = {}

    def fail(self, reason: str, pos: int | None = None) -> None:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        raise ValueError(
            f"{self.field} is not a valid grammar: {reason} at line {line}, column {col}"
        )

    def skip(self) -> None:
        self.pos = _SPACE.match(self.text, self.pos).end()

    def peek(self, s: str) -> bool:
        return self.text.startswith(s, self.pos)

    def rule_starts(self) -> bool:
        """An identifier followed by ``::=`` here: the next rule."""
        m = _IDENT.match(self.text, self.pos)
        return m is not None and _SPACE.match(self.text, m.end()).end() == self.text.find(
            "::=", m.end()
        )

    def grammar(self) -> None:
        self.skip()
        while self.pos < len(self.text):
            start = self.pos
            m = _IDENT.match(self.text, self.pos)
            if m is None or not self.rule_starts():
                self.fail("expected a rule 'name ::= ...'")
            if m.group(0) in self.defined:
                self.fail(f"rule {m.group(0)!r} is defined twice", start)
            self.defined[m.group(0)] = start
            self.pos = self.text.index("::=", m.end()) + 3
            self.skip()
            self.alternatives()
            if self.peek(")"):
                self.fail("unbalanced ')'")
        if "root" not in self.defined:
            raise ValueError(f"{self.field} is not a valid grammar: it has no 'root' rule")
        for name, pos in self.referenced.items():
            if name not in self.defined:
                self.fail(f"rule {name!r} is not defined", pos)

    def alternatives(self) -> None:
        self.sequence()
        while self.peek("|"):
            self.pos += 1
            self.skip()
            self.sequence()

    def sequence(self) -> None:
        count = 0
        while self.pos < len(self.text) and not self.peek("|") and not self.peek(")"):
            if self.rule_starts():
                break
            if self.peek("(="):  # a lookahead ends the rule's body
                self.pos += 2
                self.skip()
                self.sequence()
                self.expect(")")
                count += 1
                continue
            self.element()
            self.quantifier()
            count += 1
        if count == 0:
            self.fail("expected an element")

    def expect(self, s: str) -> None:
        if not self.peek(s):
            self.fail(f"expected {s!r}")
        self.pos += len(s)
        self.skip()

    def element(self) -> None:
        c = self.text[self.pos]
        if c == '"':
            self.string()
        elif c == "[":
            self.char_class()
        elif c == "(":
            self.pos += 1
            self.skip()
            self.alternatives()
            self.expect(")")
            return
        elif (m := _IDENT.match(self.text, self.pos)) is not None:
            self.pos = m.end()
            if self.peek("("):  # a built-in macro: its arguments are the compiler's
                self.skip_call()
            else:
                self.referenced.setdefault(m.group(0), m.start())
        else:
            self.fail(f"unexpected character {c!r}")
        self.skip()

    def quantifier(self) -> None:
        if self.pos < len(self.text) and self.text[self.pos] in "*+?":
            self.pos += 1
        elif (m := _REPEAT.match(self.text, self.pos)) is not None:
            lo, hi = int(m.group(1)), m.group(3)
            if hi and int(hi) < lo:
                self.fail(f"repetition {m.group(0)} has its upper bound below its lower")
            self.pos = m.end()
        else:
            return
        self.skip()
        if self.pos < len(self.text) and (self.text[self.pos] in "*+?{"):
            self.fail("two repetition operators in a row")

    def string(self) -> None:
        start = self.pos
        self.pos += 1
        while self.pos < len(self.text) and self.text[self.pos] != '"':
            if self.text[self.pos] == "\n":
                self.fail("a string runs past the end of its line", start)
            if self.text[self.pos] == "\\":
                m = _STRING_ESCAPE.match(self.text, self.pos)
                if m is None:
                    self.fail("invalid escape sequence")
                self.pos = m.end()
            else:
                self.pos += 1
        if self.pos >= len(self.text):
            self.fail("unterminated string", start)
        self.pos += 1

    def char_class(self) -> None:
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        while self.pos < len(self.text) and self.text[self.pos] != "]":
            if self.text[self.pos] == "\n":
                self.fail("a character class runs past the end of its line", start)
            if self.text[self.pos] == "\\":
                m = _STRING_ESCAPE.match(self.text, self.pos)
                if m is None:
                    self.fail("invalid escape sequence")
                chars.append(m.group(0))
                self.pos = m.end()
            else:
                chars.append(self.text[self.pos])
                self.pos += 1
        if self.pos >= len(self.text):
            self.fail("unterminated character class", start)
        self.pos += 1
        self._check_ranges(chars, start)

    def _check_ranges(self, chars: list[str], start: int) -> None:
        if chars and chars[0] == "^":
            chars = chars[1:]
        for i in range(1, len(chars) - 1):
            lo, hi = chars[i - 1], chars[i + 1]
            if chars[i] == "-" and len(lo) == 1 and len(hi) == 1 and lo > hi:
                self.fail(f"character range {lo}-{hi} is reversed", start)

    def skip_call(self) -> None:
        depth = 0
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == '"':
                self.string()
                continue
            depth += (c == "(") - (c == ")")
            self.pos += 1
            if depth == 0:
                return
        self.fail("unbalanced '('")


def check_ebnf(text: str, field: str) -> None:
    """Raise ValueError (starting with ``field``) unless ``text`` is a well-formed
    EBNF grammar with a ``root`` rule."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {text!r}")
    _Parser(text, field).grammar()
