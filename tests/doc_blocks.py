"""The commands the user documentation shows: fenced shell and Python blocks, and inline code spans
that start with one of the project's console scripts, from README.md, docs/ and the dataset card.

``tests/test_docs.py`` checks or runs every one of them; ``tests/test_loading.py`` runs the load
snippets against a staged release. Nothing here runs a command."""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("tpu-kernel-records", "tpu-kernel-rubric")  # pyproject's [project.scripts]
SHELL, PYTHON = ("bash", "sh", "shell", "console"), ("python",)
_FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`((?:%s) [^`\n]*)`(?!`)" % "|".join(map(re.escape, SCRIPTS)))


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def user_documents() -> list[Path]:
    """The documents a user reads (the changelog, which keeps timing history, is not one)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "dataset_card.md"]


def blocks(langs: tuple[str, ...], paths: list[Path] | None = None) -> list[Block]:
    """Every fenced block in one of ``langs``, dedented, with the line it starts on."""
    out = []
    for path in paths or user_documents():
        text = path.read_text()
        for m in _FENCE.finditer(text):
            if m.group(2) in langs:
                out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(2),
                                 textwrap.dedent(m.group(3))))
    return out


def shell_commands(block: Block) -> list[list[str]]:
    """argv of every command in a shell block: continuations joined, comments dropped, split at ``&&``,
    ``;``, ``|`` and a trailing ``&``, redirections (``> FILE``, ``2>&1``) dropped."""
    commands = []
    for line in block.text.replace("\\\n", " ").splitlines():
        argv: list[str] = []
        tokens = iter(shlex.split(line, comments=True))
        for token in tokens:
            if token in ("&&", ";", "|", "||", "&"):
                commands.append(argv)
                argv = []
            elif token in (">", ">>", "<", "2>"):
                next(tokens, None)
            elif not re.fullmatch(r"\d?>&\d", token):
                argv.append(token)
        commands.append(argv)
    return [argv for argv in commands if argv]


def inline_commands(paths: list[Path] | None = None) -> list[tuple[str, list[str]]]:
    """(where, argv) of every inline code span that starts with a console script of the project."""
    out = []
    for path in paths or user_documents():
        text = path.read_text()
        for m in _INLINE.finditer(text):
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append((where, shlex.split(m.group(1))))
    return out
