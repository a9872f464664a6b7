"""runtime/jsonl.py: the reader every metrics.jsonl consumer shares (status view, e2e harness, soak, docker test)."""
from __future__ import annotations

from gasloc.runtime.jsonl import parse_jsonl, read_jsonl


def test_a_torn_last_line_is_skipped_and_a_missing_file_is_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert read_jsonl(path) == [{"round": 1}, {"round": 2}]


def test_bytes_lines_parse_too():
    assert parse_jsonl([b'{"a": 1}', b"", b"{"]) == [{"a": 1}]
