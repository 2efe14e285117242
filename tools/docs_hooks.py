"""MkDocs hooks for the documentation site (``mkdocs.yml``, ``hooks:``).

The site is made from the checkout it is built in, wherever ``mkdocs`` runs from: the
pages that include files outside ``docs/`` (``benchmarks/README.md``, ``CHANGELOG.md``)
find them beside ``mkdocs.yml``, and the command line's help is this checkout's.

The command-line reference (``docs/reference/cli.md``) is the parser's own ``--help``,
made at build time, so that the page says what ``autoloader --help`` says and never
falls behind it: the page holds a marker line, ``<!-- autoloader help -->``, that this
hook replaces with the help of the command and of each subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

_MARKER = "<!-- autoloader help -->"
# argparse wraps at the terminal's width (COLUMNS): a fixed one makes the page the same
# on every machine that builds it.
_COLUMNS = "88"


def _help(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser.parse_args(argv)
    return out.getvalue().rstrip()


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def cli_help() -> str:
    """The Markdown for the marker: ``autoloader --help``, then each subcommand's."""
    from autoloader._cli import _parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _COLUMNS
    try:
        parser = _parser()
        sections = [("autoloader --help", _help(parser, ["--help"]))]
        sections += [
            (f"autoloader {name} --help", _help(_parser(), [name, "--help"]))
            for name in _subcommands(parser)
        ]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n\n".join(f"## `{title}`\n\n```text\n{text}\n```" for title, text in sections)


def on_config(config: Any) -> Any:
    root = str(Path(config.config_file_path).resolve().parent)
    config.mdx_configs.setdefault("pymdownx.snippets", {})["base_path"] = [root]
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    if _MARKER in markdown:
        return markdown.replace(_MARKER, cli_help())
    return markdown
