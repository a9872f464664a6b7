"""Config resolution: defaults < TOML < GASLOC_* env < flags; every mistake is one line naming it."""
import pytest
from pydantic import BaseModel, ConfigDict

from gasloc.peer.train.model import ModelConfig
from gasloc.peer.train.outer import OuterConfig
from gasloc.runtime.config import ConfigError, dump_toml, resolve


class Cfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_dir: str = "runs/x"
    initial_peers: list[str] = []
    outer: OuterConfig = OuterConfig()
    model: ModelConfig = ModelConfig()


def test_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('run_dir = "from-file"\n[outer]\nmomentum = 0.1\nouter_lr = 0.5\n[model]\nseq_len = 64\n')
    env = {"GASLOC_OUTER__MOMENTUM": "0.2", "GASLOC_MODEL__SEQ_LEN": "32"}
    c = resolve(Cfg, f, flags={"model.seq_len": 16, "run_dir": None}, environ=env)
    assert (c.run_dir, c.outer.outer_lr, c.outer.momentum, c.model.seq_len) == ("from-file", 0.5, 0.2, 16)


def test_env_lists_accept_commas_and_json():
    assert resolve(Cfg, environ={"GASLOC_INITIAL_PEERS": "a,b"}).initial_peers == ["a", "b"]
    assert resolve(Cfg, environ={"GASLOC_INITIAL_PEERS": '["c"]'}).initial_peers == ["c"]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(environ={"GASLOC_OUTR__X": "1"}), "unknown environment variable GASLOC_OUTR__X"),
    (dict(environ={"GASLOC_OUTER__MOMENTUM": "2"}), "bad value for 'outer.momentum'"),
    (dict(flags={"model.preset": "huge"}, environ={}), "unknown preset 'huge'"),
])
def test_errors_are_one_line_and_name_the_problem(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        resolve(Cfg, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer]\nmomentom = 0.3\n")
    with pytest.raises(ConfigError, match="unknown key 'outer.momentom'"):
        resolve(Cfg, bad, environ={})
    bad.write_text("[outer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(Cfg, bad, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(Cfg, tmp_path / "missing.toml", environ={})


def test_dump_round_trips(tmp_path):
    c = resolve(Cfg, flags={"outer.algorithm": "diloco"}, environ={})
    f = tmp_path / "out.toml"
    f.write_text(dump_toml(c))
    assert resolve(Cfg, f, environ={}) == c
