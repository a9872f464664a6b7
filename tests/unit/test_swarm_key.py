"""Swarm key files: `gasloc keygen`, what a usable key is, and one-line errors for the rest on every command."""
from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from gasloc.cli.main import cli
from gasloc.peer.swarm.swarmkey import load_swarm_key
from gasloc.protocol.auth import SwarmKeyError


def test_keygen_writes_a_private_key_once(tmp_path):
    path = tmp_path / "swarm.key"
    res = CliRunner().invoke(cli, ["keygen", str(path)])
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_swarm_key(path)
    assert len(key) == 32 and path.read_text().strip() == key.hex()
    again = CliRunner().invoke(cli, ["keygen", str(path)])
    assert again.exit_code == 2 and "already exists" in again.output
    assert load_swarm_key(path) == key


def test_a_key_made_by_other_means_works(tmp_path):
    path = tmp_path / "k"
    path.write_text("  " + "ab12" * 20 + "\n")       # 40 bytes, whitespace around
    path.chmod(0o600)
    assert load_swarm_key(path) == bytes.fromhex("ab12" * 20)


@pytest.mark.parametrize("text,why", [
    ("", "empty"), ("ab" * 31, "31 bytes"), ("zz" * 32, "hex digits only"), ("abc", "hex digits only"),
    ("00" * 32, "one byte repeated"),
])
def test_weak_or_malformed_keys_are_refused(tmp_path, text, why):
    path = tmp_path / "k"
    path.write_text(text)
    with pytest.raises(SwarmKeyError, match=why):
        load_swarm_key(path)


@pytest.mark.parametrize("command", [["peer"], ["bootstrap"], ["swarm"]])
@pytest.mark.parametrize("problem", ["missing", "weak"])
def test_every_command_gives_one_line_for_a_bad_key(tmp_path, command, problem):
    path = tmp_path / "k"
    if problem == "weak":
        path.write_text("ab" * 8)
    res = CliRunner().invoke(cli, [*command, "--swarm-key", str(path), "--print-config"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error") and str(path) in lines[0], res.output


def test_the_key_is_reachable_from_config_and_env(tmp_path, monkeypatch):
    path = tmp_path / "k"
    CliRunner().invoke(cli, ["keygen", str(path)])
    monkeypatch.setenv("GASLOC_SWARM__KEY_PATH", str(path))
    res = CliRunner().invoke(cli, ["peer", "--print-config"])
    assert res.exit_code == 0 and f'key_path = "{path}"' in res.output, res.output
