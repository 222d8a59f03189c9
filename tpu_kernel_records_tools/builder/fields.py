"""The card's Data Fields: per config, every column (name, type, unit, meaning, when null) and one example row.

Types come from ``records.schema.FEATURES``, words from ``records.columns.COLUMNS``; a column without a
description (or a description of no column) raises ``ValueError``, so the build fails instead of
publishing an unexplained column. The example row is real: the first row of the most telling record
(measured before submitted before published before grader-power; a check row before a power row),
with long lists and strings shortened, as JSON in a code block with ``<>&``, backticks and
link shapes escaped (so no string a run supplies is markup or a link).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa

from .markdown import Markdown, code, table
from ..records.columns import COLUMNS, MEMBERS
from ..records.schema import CONFIG_NAMES, FEATURES

SOURCE_RANK = ("measured", "submitted", "published-summary", "grader-power")
MAX_ITEMS, MAX_CHARS = 3, 100  # an example row's lists and strings are shortened past these


def type_name(kind: pa.DataType) -> str:
    """A column's type as a reader of the parquet files sees it: ``list<float64>``, ``struct``, ..."""
    if pa.types.is_list(kind):
        return f"list<{type_name(kind.value_type)}>"
    if pa.types.is_struct(kind):
        return "struct"
    if pa.types.is_timestamp(kind):
        return f"timestamp[{kind.unit}, {kind.tz}]"
    return {"bool": "bool", "string": "string", "int64": "int64", "double": "float64"}.get(str(kind), str(kind))


def member_types(kind: pa.DataType, prefix: str = "") -> dict[str, pa.DataType]:
    """Every member path of a struct (or list of structs) type, dotted, ``[]`` stepping into a list's items."""
    if pa.types.is_list(kind) and pa.types.is_struct(kind.value_type):
        return member_types(kind.value_type, prefix + "[]")
    if not pa.types.is_struct(kind):
        return {}
    out: dict[str, pa.DataType] = {}
    for field in kind:
        path = f"{prefix}.{field.name}" if prefix else field.name
        out[path] = field.type
        out.update(member_types(field.type, path))
    return out


def undescribed() -> list[str]:
    """``config.column`` for every column without a description and every description of no column, and
    likewise for the members of the struct columns ``records.columns.MEMBERS`` describes."""
    problems = []
    for name, columns in MEMBERS.items():
        for column, described in columns.items():
            declared = set(member_types(FEATURES[name].field(column).type))
            problems += [f"{name}.{column}.{m}: no description in records.columns.MEMBERS"
                         for m in sorted(declared - set(described))]
            problems += [f"{name}.{column}.{m}: described in records.columns.MEMBERS but not a member"
                         for m in sorted(set(described) - declared)]
    for name in CONFIG_NAMES:
        declared, described = set(FEATURES[name].names), set(COLUMNS.get(name, {}))
        problems += [f"{name}.{c}: no description in records.columns" for c in sorted(declared - described)]
        problems += [f"{name}.{c}: described in records.columns but not a column" for c in
                     sorted(described - declared)]
        problems += [f"{name}.{c}: a description holds '|' or a line break (it would break the table)"
                     for c, words in COLUMNS.get(name, {}).items() if any(set("|\n") & set(w) for w in words)]
    return problems


def _short(value: Any) -> Any:
    if isinstance(value, list):
        kept = [_short(v) for v in value[:MAX_ITEMS]]
        return kept + ([f"... {len(value) - MAX_ITEMS} more"] if len(value) > MAX_ITEMS else [])
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, str) and len(value) > MAX_CHARS:
        return value[:MAX_CHARS] + "..."
    return value


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal


def _inert(match: re.Match) -> str:
    """A JSON string literal, the same string, with nothing in it that Markdown or HTML could act on:
    ``<>&``, backticks and brackets as ``\\uXXXX``, ``://`` as ``:\\/\\/``, ``www.`` as ``www\\u002e``."""
    literal = match.group(0)
    for char in "<>&`[]":
        literal = literal.replace(char, f"\\u{ord(char):04x}")
    return literal.replace("://", ":\\/\\/").replace("www.", "www\\u002e")


def example(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The example row of a config (see the module docstring), or None when it has no rows."""
    def rank(row: dict[str, Any]) -> tuple[int, int]:
        source = SOURCE_RANK.index(row["source"]) if row["source"] in SOURCE_RANK else len(SOURCE_RANK)
        return source, row.get("row_kind") == "power"
    return min(rows, key=rank) if rows else None


def section(tables: dict[str, pa.Table]) -> str:
    """The ``fields`` section: a Data Fields table and a Data Instance per config."""
    problems = undescribed()
    if problems:
        raise ValueError("every column needs a description:\n  " + "\n  ".join(problems))
    out = []
    for name in CONFIG_NAMES:
        rows = [[Markdown(f"`{c}`"), Markdown(f"`{type_name(FEATURES[name].field(c).type)}`"),
                 *map(Markdown, COLUMNS[name][c])]
                for c in FEATURES[name].names]
        out.append(f"### `{name}`\n\n" + table(["Column", "Type", "Unit", "Meaning", "Null when"], rows))
        for column, described in MEMBERS.get(name, {}).items():
            kinds = member_types(FEATURES[name].field(column).type)
            members = [[Markdown(f"`{column}.{m}`"), Markdown(f"`{type_name(kinds[m])}`"), *map(Markdown, described[m])]
                       for m in kinds]
            out.append(f"Members of `{column}`:\n\n" + table(["Member", "Type", "Unit", "Meaning"], members))
        row = example(tables[name].to_pylist())
        if row is not None:
            shown = _STRING.sub(_inert, json.dumps(_short(row), indent=1, default=str, allow_nan=True))
            out.append(f"<details><summary>An example row of {name}</summary>\n\nFrom record "
                       f"{code(row['record_id'])}, long lists and strings shortened:\n\n```json\n{shown}\n```\n\n"
                       "</details>\n")
    return "\n".join(out)
