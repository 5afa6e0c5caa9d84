"""docs/flags.md: every flag of every command, generated from the parsers.

    python -m pdserve.flags_doc            # rewrite docs/flags.md
    python -m pdserve.flags_doc --check    # exit 1 if it is stale

The page is built from the very argparse parsers the commands use (pdserve/cli.py
builds `pdserve`'s, router/admin/pdctl.py pdctl's), with every PDSERVE_* and
PDCTL_* variable unset so that the defaults shown are the built-in ones.
tests/unit/pdserve/test_flags_doc.py fails when the page is not what this
writes: change a flag, run the command above.

One table per command: the flag, the environment variable that sets it (as its
help names it, ``[PDSERVE_X]``), its default and its help. Flags shared by
commands documented together (prefill and decode nodes, pdctl's commands) are
listed once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
# The variable a flag's help names, e.g. "[PDSERVE_KV_LEASE_S]", "[PDSERVE_VERIFY_KV=1]".
VARIABLE = re.compile(r"\s*\[((?:PDSERVE|PDCTL)_[A-Z0-9_]+)([^\]]*)\]")
# The engine's options carry no help of their own: their defaults are the engine's.
ENGINE_NOTE = (
    " (from --max-model-len on, the engine's options: unset, each takes the engine's "
    "default, which docs/engine.md lists with what it allows)"
)
HEADER = """# Flags

Every flag of every command, with the environment variable that sets it and
its default. Generated from the commands' own parsers by
`python -m pdserve.flags_doc` (a unit test fails when this page is stale): do
not edit by hand. Where a flag and its variable are both given, the flag wins;
an empty variable counts as unset. What the knobs mean in depth:
docs/routing.md (routing), docs/reliability.md (timeouts, leases, restarts),
docs/security.md (tokens, TLS), docs/metrics.md, docs/operations.md.
"""


@contextlib.contextmanager
def builtin_defaults() -> Iterator[None]:
    """No PDSERVE_* / PDCTL_* variable while the parsers are built."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("PDSERVE_", "PDCTL_"))}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommands, each parser with its one-line help as description."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                sub.description = sub.description or helps.get(name)
            return dict(action.choices)
    return {}


def _flags(action: argparse.Action) -> str:
    names = action.option_strings or [action.metavar or action.dest.upper()]
    return ", ".join(f"`{n}`" for n in names)


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(default, list | tuple):
        return " ".join(str(d) for d in default)
    return f"`{default}`" if str(default) else ""


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str]:
    """(variable, help) of one flag, the help on one line."""
    # A plain formatter: some parsers' add "(default: ...)", which has its own column.
    text = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
    variable = ""
    if m := VARIABLE.search(text):
        variable = f"`{m.group(1)}{m.group(2).split(';')[0]}`".replace("|", "\\|")
        rest = m.group(2).split(";", 1)[1].strip() if ";" in m.group(2) else ""
        text = text[: m.start()] + (f" ({rest})" if rest else "") + text[m.end() :]
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(str(c) for c in action.choices)})"
    return variable, " ".join(text.split()).replace("|", "\\|")


def _documented(action: argparse.Action) -> bool:
    return not isinstance(
        action, argparse._HelpAction | argparse._SubParsersAction | argparse._VersionAction
    )


def table(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> list[str]:
    rows = ["| flag | variable | default | what |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if not _documented(action) or _key(action) in skip:
            continue
        variable, text = _help(parser, action)
        rows.append(f"| {_flags(action)} | {variable} | {_default(action)} | {text} |")
    return rows if len(rows) > 2 else []


def _key(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def _same(action: argparse.Action) -> tuple:
    """What must match for a flag to count as the same in several commands."""
    return (_key(action), repr(action.default), action.help)


def section(title: str, parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> list[str]:
    rows = table(parser, skip)
    intro = parser.description or ""
    lines = [f"## {title}", ""]
    if intro:
        lines += [intro, ""]
    return lines + (rows or ["No flags of its own."]) + [""]


def shared(
    title: str, parsers: dict[str, argparse.ArgumentParser], what: str, note: str = ""
) -> list[str]:
    """Commands documented together: the flags all of them take alike, once,
    then each one's own."""
    same = [{_same(a) for a in p._actions if _documented(a)} for p in parsers.values()]
    common = {key for key, _, _ in set.intersection(*same)}
    first = next(iter(parsers.values()))
    lines = [f"## {title}", "", f"Every {what} takes these{note}:", ""]
    lines += table(first, {_key(a) for a in first._actions if _key(a) not in common}) + [""]
    for name, parser in parsers.items():
        lines += [f"### {name}", ""]
        if parser.description:
            lines += [parser.description, ""]
        lines += (table(parser, common) or ["No flags of its own."]) + [""]
    return lines


def render() -> str:
    """The whole page."""
    with builtin_defaults():
        from pdserve.cli import build_parser
        from router.admin.pdctl import build_parser as pdctl_parser

        pdserve = subcommands(build_parser())
        bench = subcommands(pdserve["bench"])
        pdctl = pdctl_parser()
        lines = [HEADER]
        lines += section("`pdserve up`", pdserve["up"])
        lines += section("`pdserve router`", pdserve["router"])
        nodes = {"`pdserve prefill`": pdserve["prefill"], "`pdserve decode`": pdserve["decode"]}
        lines += shared("`pdserve prefill` and `pdserve decode`", nodes, "node", ENGINE_NOTE)
        lines += section("`pdserve generate`", pdserve["generate"])
        lines += section("`pdserve bench serve`", bench["serve"])
        lines += section("`pdserve bench plot`", bench["plot"])
        lines += section("`pdserve model prepare`", subcommands(pdserve["model"])["prepare"])
        lines += section("`pdserve demo`", pdserve["demo"])
        lines += section("`pdctl`", pdctl)
        commands = {f"`pdctl {name}`": p for name, p in subcommands(pdctl).items()}
        lines += shared("`pdctl` commands", commands, "pdctl command")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write docs/flags.md from the parsers")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is stale: run python -m pdserve.flags_doc", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
