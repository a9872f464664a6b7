"""Reading JSON-lines files that another process is still appending to (metrics.jsonl of a live or killed peer)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def parse_jsonl(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """The complete records among `lines`; a line torn by a kill or still being written is skipped, not an error."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of the file at `path`; [] when it does not exist (yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return parse_jsonl(text.splitlines())
