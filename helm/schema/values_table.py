"""The values table of helm/crescent/README.md, generated from values.yaml's `# --` comments and
the schema's types (helm/schema/generate.py writes and checks it with the schema)."""

from __future__ import annotations

import json
import re
from typing import Any

START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"
_KEY = re.compile(r'^(\s*)("[^"]+"|[^\s#:-][^:]*):(\s.*)?$')


def documented_keys(values_text: str) -> list[tuple[str, str]]:
    """(dotted key, description) for every key a `# --` comment block documents, in file order."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] | None = None
    for line in values_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if comment is not None:
                comment.append(stripped[1:].strip())
            continue
        match = _KEY.match(line)
        if not match or stripped.startswith("- "):
            comment = None
            continue
        indent, key = len(match.group(1)), match.group(2).strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if comment is not None:
            found.append((".".join(k for _, k in stack), " ".join(comment)))
        comment = None
    return found


def _lookup(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree[part]
    return tree


def _schema_type(schema: dict[str, Any], path: str) -> str:
    node = schema
    for part in path.split("."):
        node = node.get("properties", {}).get(part) or node.get("additionalProperties") or {}
    kind = node.get("type", "")
    return " or ".join(kind) if isinstance(kind, list) else kind


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def values_table(values_text: str, values: dict[str, Any], schema: dict[str, Any]) -> str:
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for path, description in documented_keys(values_text):
        default = json.dumps(_lookup(values, path), separators=(",", ":"))
        if len(default) > 60:
            default = default[:57] + "..."
        rows.append(f"| `{path}` | {_schema_type(schema, path)} | `{_cell(default)}` | {_cell(description)} |")
    return "\n".join(rows)


def with_table(readme: str, table: str) -> str:
    """The README with the text between the markers replaced by `table`."""
    if START not in readme or END not in readme:
        raise ValueError(f"helm/crescent/README.md lacks the markers {START} and {END}")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"
