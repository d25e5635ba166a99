"""Write docs/flags.md from the CLI's own parser (`prefixserve.cli.build_parser`), so the flags
reference is what `prefixserve <command> --help` says, never a copy that drifts.

    .venv/bin/python tools/flags_doc.py            # rewrite docs/flags.md
    .venv/bin/python tools/flags_doc.py --check    # exit 1 when docs/flags.md is out of date

tests/test_docs.py runs the check; a new or changed flag fails it until the file is rewritten.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS_MD = ROOT / "docs" / "flags.md"
COMMAND = ".venv/bin/python tools/flags_doc.py"


def render(parser: argparse.ArgumentParser) -> str:
    """The whole of docs/flags.md: one section per subcommand, one table row per argument, in the
    parser's order. Pure: the same parser always gives the same text."""
    lines = [
        "# Command-line flags",
        "",
        f"Generated from the parser by `{COMMAND}`; do not edit by hand (`tests/test_docs.py` fails",
        "when this file and `prefixserve <command> --help` disagree, and that command rewrites it).",
        "Every `serve` flag but the repeatable `--price` can also be set by the `PREFIXSERVE_*`",
        "environment variable its description names; a flag given on the command line wins.",
    ]
    for name, sub in _subcommands(parser).items():
        lines += ["", f"## `prefixserve {name}`", ""]
        if sub.description or _help_of(parser, name):
            lines += [sub.description or _help_of(parser, name), ""]
        lines += ["| flag | value | what it does |", "|---|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            lines.append(_row(action))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 on a difference"
    )
    check = args.parse_args(argv).check
    sys.path.insert(0, str(ROOT))
    from prefixserve.cli import build_parser

    text = render(build_parser())
    if not check:
        FLAGS_MD.write_text(text)
        print(f"wrote {FLAGS_MD.relative_to(ROOT)}")
        return 0
    if FLAGS_MD.exists() and FLAGS_MD.read_text() == text:
        return 0
    print(f"{FLAGS_MD.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
    return 1


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name and choice.help:
                    return str(choice.help)
    return ""


def _row(action: argparse.Action) -> str:
    flag = ", ".join(action.option_strings) if action.option_strings else action.dest
    if action.choices is not None:
        value = "\\|".join(str(c) for c in action.choices)
    elif action.nargs == 0:
        value = ""
    else:
        value = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    text = action.help or ""
    if isinstance(action, argparse._AppendAction) and "repeat" not in text:
        text += " (repeatable)"
    if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
        text += f" (default {action.default})"
    return f"| `{flag}` | {f'`{value}`' if value else ''} | {_cell(text.strip())} |"


def _cell(text: str) -> str:
    """Help text as one table cell: `|` would end the cell, `<...>` read as HTML, `*` as emphasis."""
    text = " ".join(text.split())
    for char in "|<*":
        text = text.replace(char, "\\" + char)
    return text


if __name__ == "__main__":
    sys.exit(main())
