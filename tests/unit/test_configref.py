"""docs/configuration.md is generated from the config models; this keeps the two from drifting apart."""
from pathlib import Path

from click.testing import CliRunner

from gasloc.cli.configref import CONFIGS, config_reference, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_is_up_to_date():
    assert DOC.read_text() == render(), "regenerate: gasloc config-reference > docs/configuration.md"


def test_every_command_and_key_is_documented():
    text = CliRunner().invoke(config_reference).output
    for command in CONFIGS:
        assert f"## `gasloc {command}`" in text
    for key in ("`outer.algorithm`", "`exchange.exchange_timeout_s`", "`checkpoint.every_rounds`", "`port`"):
        assert key in text
