"""Markdown for the card's generated parts, with every value a run supplies shown as literal text.

A run is a stranger's file: its device name, versions, candidate names, error strings reach the
card (the Hub README). Rendered as they are, ``<!--`` would hide the rest of the card (its terms
included), ``[x](url)`` or ``![x](url)`` would add a link or an image, ``|`` or a newline a table
cell or a line. ``text`` makes any value inert; ``code`` shows a name as code where it is plainly
one; ``table`` renders rows whose values are escaped unless already ``Markdown``.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any, Sequence

EMPTY = "—"
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_BACKSLASHED = set("\\`*_~[]|$")  # emphasis, code, links, table cells (and TeX math where rendered)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+:=@ -]*")


class Markdown(str):
    """A string that is already Markdown: ``table`` keeps it as it is."""


def _one_line(value: str) -> str:
    """Control and format characters (newlines, bidi overrides) and line separators as spaces."""
    return "".join(" " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in value)


def text(value: Any) -> Markdown:
    """``value`` as literal one-line Markdown text (``EMPTY`` for ``None``)."""
    if value is None:
        return Markdown(EMPTY)
    escaped = "".join(_ENTITIES.get(c) or ("\\" + c if c in _BACKSLASHED else c)
                      for c in _one_line(str(value)))
    return Markdown(escaped.replace("://", "&#58;//").replace("www.", "www&#46;"))  # no autolinks


def code(value: Any) -> Markdown:
    """``value`` in a code span where it is a plain name (letters, digits, ``._/+:=@ -``), else as
    ``text``: a backtick could close the span."""
    if value is not None and _PLAIN_NAME.fullmatch(str(value)) and "://" not in str(value):
        return Markdown(f"`{value}`")
    return text(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; each cell ``text`` unless it is ``Markdown`` already."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, Markdown) else text(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def megabytes(n: float) -> str:
    """Bytes as megabytes (10^6) for a card's table: one decimal from 10 MB, three significant digits below."""
    return f"{n / 1e6:,.1f}" if n >= 1e7 else f"{n / 1e6:.3g}"
