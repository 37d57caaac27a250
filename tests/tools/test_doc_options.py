"""Every ``--option`` the docs give a command is one of that command's options, and every concrete ``ldlm``
command line in them parses.

A command is named as ``ldlm SUBCOMMAND``, ``python scripts/X.py`` or ``python -m ldlm.X`` in inline code or a
code block; its options are the ``--words`` after it in the same span or line. An option alone in a span
(`` `--max-queue` ``) belongs to the command named last before it in its paragraph, else to the page's own:
``ldlm serve`` on serving.md, the section's subcommand on cli.md. The subcommands' options come from the CLI's
own parser; a script's from the ``add_argument`` calls in its source.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest

from ldlm.cli import build_parser
from tests import REPO
from tests.tools.test_documented_dependencies import source_file

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGE_COMMANDS = {"serving.md": "ldlm serve"}  # what a page's lone options belong to, where its text names no other
COMMAND = re.compile(r"\bldlm ([a-z][a-z0-9-]*)|\bscripts/[\w/]+\.py|-m (ldlm(?:\.\w+)+)")
OPTION = re.compile(r"(?<![\w./-])--[a-z][a-z0-9-]*")
LONE_OPTION = re.compile(r"--[a-z][a-z0-9-]*(?:[ =][^`]*)?")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def script_options(path: Path) -> set[str]:
    """The option strings a script's (or module's) ``add_argument`` calls declare, as patterns: an f-string
    (f"--{name}-port") matches any word where it formats a value."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.JoinedStr):
                    found.add("".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"[\w-]+" for v in arg.values))
                elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(re.escape(arg.value))
    return {pattern for pattern in found if pattern.startswith("\\-\\-")}


def options_of(command: str) -> set[str] | None:
    """``command``'s options as patterns ("ldlm serve", "scripts/x.py", "ldlm.serve.x"), or None when it is no
    command here (`from ldlm import ...` in Python)."""
    if command.startswith("ldlm "):
        parser = subcommands().get(command.split()[1])
        return {re.escape(option) for option in parser._option_string_actions} if parser else None
    path = REPO / command if command.endswith(".py") else source_file(command)
    return script_options(path) if path is not None and path.is_file() else None


@dataclass(frozen=True)
class Span:
    doc: Path
    line: int
    text: str  # an inline code span, or one line of a code block
    sentence: int  # which sentence of the page it is in (code blocks: each line its own)
    section: str  # the `## ` heading above it
    shell: bool = False  # a line of a bash code block: a whole command, not a name in prose


SENTENCE_END = re.compile(r"[.;!?](?:\s|$)")
NEW_SENTENCE_LINE = re.compile(r"\s*$|#|- |\||\d+\. ")  # a blank line, a heading, a list item or a table row


def spans(doc: Path) -> Iterator[Span]:
    block, sentence, section, held, shell = False, 0, "", "", False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            block, shell = not block, line.strip() in ("```bash", "```sh", "```shell")
        if line.startswith("```") or block:
            sentence += 1  # each command of a code block stands alone; a trailing backslash continues it
            command = held + line.split(" #")[0]
            held = command.removesuffix("\\") if command.endswith("\\") else ""
            if not line.startswith("```") and not held:
                yield Span(doc, number, command, sentence, section, shell)
            continue
        section = line[3:].strip() if line.startswith("## ") else section
        sentence += bool(NEW_SENTENCE_LINE.match(line))
        prose = re.split(r"`[^`]+`", line)  # the text around the spans says where a sentence ends
        for gap, match in zip(prose, re.finditer(r"`([^`]+)`", line)):
            sentence += bool(SENTENCE_END.search(gap))
            yield Span(doc, number, match.group(1), sentence, section)
        sentence += bool(SENTENCE_END.search(prose[-1]))


def command_name(match: re.Match[str]) -> str:
    sub, module = match.group(1), match.group(2)
    return f"ldlm {sub}" if sub else module or match.group(0)


def named_options(span: Span) -> Iterator[tuple[str, str]]:
    """(command, option) for each option after a command named in the span."""
    found = list(COMMAND.finditer(span.text))
    for i, match in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(span.text)
        yield from ((command_name(match), option) for option in OPTION.findall(span.text[match.end() : end]))


def owner_of_lone_option(span: Span, earlier: list[Span]) -> str | None:
    """The command a lone option belongs to: the last named before it in its sentence, else the page's
    (serving.md's `ldlm serve`, the cli.md section's subcommand); None on other pages, whose lone options
    may be any command's."""
    if span.doc.name not in PAGE_COMMANDS and span.doc.name != "cli.md":
        return None
    for before in reversed([s for s in earlier if s.sentence == span.sentence]):
        if named := [command_name(m) for m in COMMAND.finditer(before.text)]:
            return named[-1]
    if span.doc.name == "cli.md":
        return f"ldlm {span.section}" if span.section in subcommands() else None
    return PAGE_COMMANDS.get(span.doc.name)


def shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


def unknown_options(docs: list[Path] = DOCS) -> list[str]:
    """Each option the docs give a command that lacks it, as "doc:line: command has no --option"."""
    unknown = []
    for doc in docs:
        seen: list[Span] = []
        for span in spans(doc):
            pairs = list(named_options(span))
            if not pairs and LONE_OPTION.fullmatch(span.text):
                owner = owner_of_lone_option(span, seen)
                pairs = [(owner, OPTION.findall(span.text)[0])] if owner else []
            for command, option in pairs:
                known = options_of(command)
                if known is not None and not any(re.fullmatch(pattern, option) for pattern in known):
                    unknown.append(f"{shown(doc)}:{span.line}: {command} has no {option}")
            seen.append(span)
    return unknown


def concrete_command_lines(docs: list[Path] = DOCS) -> Iterator[tuple[str, str]]:
    """("doc:line", command) for each ``ldlm`` line of a bash block with no placeholder (CKPT, [--opt], A|B, ...)
    to fill in."""
    for doc in docs:
        for span in filter(lambda s: s.shell, spans(doc)):
            text = span.text.strip()
            command = re.match(r"ldlm ([a-z][a-z0-9-]*)(?:\s|$)", text)
            if command and command.group(1) in subcommands() and not re.search(r"[\[\]|<>]|\.\.\.|\b[A-Z]{2,}\b|\$", text):
                yield f"{shown(doc)}:{span.line}", text


def test_every_option_the_docs_give_a_command_is_its_own() -> None:
    unknown = unknown_options()
    assert not unknown, "options the docs name that the command does not have:\n" + "\n".join(unknown)


def test_every_concrete_command_line_in_the_docs_parses() -> None:
    refused = []
    for where, line in concrete_command_lines():
        with redirect_stderr(StringIO()) as said, redirect_stdout(StringIO()):
            try:
                build_parser().parse_args(shlex.split(line, comments=True)[1:])
            except SystemExit as exit:
                if exit.code:  # --help exits 0
                    refused.append(f"{where}: {line}\n    {said.getvalue().strip().splitlines()[-1]}")  # fmt: skip
    assert not refused, "documented command lines the CLI refuses:\n" + "\n".join(refused)


def test_the_check_finds_planted_options(tmp_path: Path) -> None:
    """The check itself: a serve option that does not exist, named alone on serving.md and after `ldlm serve`,
    and a script's option given to the CLI, are found; a script's own option after its name is not."""
    page = tmp_path / "serving.md"
    page.write_text(
        "Refused above the server's `--max-steps`.\n\n"
        "```bash\nldlm serve runs/onnx --max-steps 5   # a comment: --not-an-option\n```\n\n"
        "Load: `python scripts/load_test.py --clients 16` (`--url` for a running one), or `ldlm serve --url`.\n"
    )
    assert unknown_options([page]) == [
        "serving.md:1: ldlm serve has no --max-steps",
        "serving.md:4: ldlm serve has no --max-steps",
        "serving.md:7: ldlm serve has no --url",
    ]


@pytest.mark.parametrize("line", ["ldlm serve runs/onnx --max-steps 5", "ldlm tune-schedule"])
def test_the_parse_check_refuses_a_planted_line(line: str) -> None:
    with redirect_stderr(StringIO()), pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split(line)[1:])
