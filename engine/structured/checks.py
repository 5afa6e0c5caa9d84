"""The checks structured-outputs validation shares: size limits and regexes (torch-free)."""

from __future__ import annotations

import re
import warnings

# A spec's text (a schema's JSON, a regex, a grammar, the choices together):
# compile time grows with it, and a node compiles while it serves.
MAX_SPEC_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024

# Regex constructs xgrammar's regex converter does not support (it refuses
# them at compile time; refusing them here names them before any node works).
_REGEX_UNSUPPORTED = (
    (re.compile(r"\(\?<?[=!]"), "lookaround assertions"),
    (re.compile(r"\(\?P?[<=]"), "named groups and references"),
    (re.compile(r"\(\?[a-zA-Z-]+[:)]"), "inline flags"),
    (re.compile(r"\\[1-9]|\\k<"), "backreferences"),
    (re.compile(r"\\[bB]"), "word boundaries"),
    (re.compile(r"\\[pP]"), "unicode property classes"),
    (re.compile(r"[*+?}]\+"), "possessive quantifiers"),
    (re.compile(r"\{,\d*\}"), "repetitions without a lower bound"),
    # xgrammar would read these as the letters themselves.
    (re.compile(r"\\[AZzG]"), "the anchors \\A, \\Z, \\z, \\G (use ^ and $)"),
)


def check_size(field: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(
            f"{field} is too large to compile: {len(text)} characters, at most {MAX_SPEC_CHARS}"
        )


def check_regex(pattern: object, field: str) -> None:
    """A regex the backend can compile: Python's ``re`` parses it and it uses
    none of the constructs xgrammar leaves out."""
    if not isinstance(pattern, str):
        raise ValueError(f"{field} must be a string, got {pattern!r}")
    check_size(field, pattern)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re's FutureWarnings on odd classes
            re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field} is not a valid regex: {e}") from None
    skeleton = _regex_skeleton(pattern)
    for construct, what in _REGEX_UNSUPPORTED:
        m = construct.search(skeleton)
        if m is not None:
            raise ValueError(
                f"{field} uses {what} ({m.group(0)!r}), which structured outputs do not support"
            )


def _regex_skeleton(pattern: str) -> str:
    """The pattern with each character class replaced by ``C`` and each escaped
    punctuation character by ``L`` (escaped letters and digits stay: they are
    the escapes the checks look for), so that no check reads a class's content
    or a literal as syntax. ``re`` has parsed it already: classes are closed."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            out.append("\\" + nxt if nxt.isalnum() else "L")
            i += 2
        elif c == "[":
            i = _class_end(pattern, i)
            out.append("C")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that starts at ``pattern[i]``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1  # a leading "]" is a literal
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
