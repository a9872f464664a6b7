"""`gasloc peer`'s config tree: precedence, one-line errors, initial peers, cross-field checks, the CLI surface."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from gasloc.peer.cli import peer as peer_cli
from gasloc.peer.config import PeerConfig
from gasloc.runtime.config import ConfigError, resolve

MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWSWbk2RE5CtFJzV2L6FA7Q67TykZZ1JZesKci3etsViNJ"


def test_defaults_listen_on_every_interface_and_checkpoint_under_run_dir():
    cfg = resolve(PeerConfig, environ={})
    assert cfg.network.listen_maddrs == ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
    assert cfg.run_dir == Path("runs/gasloc/peer")
    assert cfg.checkpoint_dir == Path("runs/gasloc/peer/checkpoints")
    assert cfg.outer.algorithm == "gasloc"


def test_precedence_toml_then_env_then_flags(tmp_path):
    f = tmp_path / "peer.toml"
    f.write_text('[swarm]\npartner_deadline_s = 3.0\nrun_id = "from-toml"\n[inner]\ninner_steps = 7\n'
                 '[network]\nport = 4000\n')
    env = {"GASLOC_SWARM__RUN_ID": "from-env", "GASLOC_INNER__INNER_STEPS": "9"}
    cfg = resolve(PeerConfig, f, {"swarm.run_id": "from-flag", "network.port": None}, environ=env)
    assert cfg.swarm.partner_deadline_s == 3.0          # TOML only
    assert cfg.inner.inner_steps == 9                   # env beats TOML
    assert cfg.swarm.run_id == "from-flag"              # flag beats env
    assert cfg.network.port == 4000                     # a flag left unset does not override
    assert cfg.network.listen_maddrs[0] == "/ip4/0.0.0.0/tcp/4000"


@pytest.mark.parametrize("toml, env, needle", [
    ("[swarm]\npartner_deadlin_s = 3\n", {}, "unknown key 'swarm.partner_deadlin_s'"),
    ("", {"GASLOC_SWARM__TTL": "3"}, "unknown environment variable GASLOC_SWARM__TTL"),
    ("[swarm]\nannounce_ttl_s = 0.1\n", {}, "'swarm.announce_ttl_s'"),
    ("[swarm]\nrun_id = \"a.b\"\n", {}, "run_id must be 1-64 letters"),
    ("[swarm]\nmin_backoff_s = 10\nmax_backoff_s = 5\n", {}, "max_backoff_s 5.0 is below min_backoff_s 10.0"),
    ("", {"GASLOC_SWARM__SLOWER_LINK_RATIO": "0.5"}, "slower_link_ratio 0.5 must be above 1"),
    ("[swarm]\nslower_link_open_share = 2\n", {}, "'swarm.slower_link_open_share'"),
    ("[diloco]\nmatchmaking_time_s = 2\nrequest_timeout_s = 3\n", {}, "request_timeout_s must be below"),
    ("[outer]\nalgorithm = \"local\"\n", {}, "never communicates"),
    ("[run]\ndevice = \"tpu\"\n", {}, "'run.device'"),
    ("[network]\nannounce_maddrs = [\"/ip4/1.2.3.4/tcp/0\"]\n", {}, "has port 0"),
    ("[network]\nhost_maddrs = [\"/ip4/127.0.0.1/tcp/99999\"]\n", {}, "tcp port '99999' is not a number from 0"),
    ("[network]\nhost_maddrs = [\"/ip4/0.0.0.0/udp/x/quic\"]\n", {}, "udp port 'x'"),
    ("[network]\nhost_maddrs = [\"/ip4/300.1.1.1/tcp/1\"]\n", {}, "'300.1.1.1' is not an ip4 address"),
    ("[network]\nannounce_maddrs = [\"/ip6/1.2.3.4/tcp/5\"]\n", {}, "'1.2.3.4' is not an ip6 address"),
    ("[network]\nhost_maddrs = [\"/ip4/127.0.0.1/tcp\"]\n", {}, "tcp port '' is not"),
])
def test_mistakes_are_one_line_errors_naming_the_field(tmp_path, toml, env, needle):
    f = tmp_path / "peer.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as e:
        resolve(PeerConfig, f, environ=env)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_initial_peers_accept_maddrs_and_files_of_them(tmp_path, monkeypatch):
    (tmp_path / "boot.txt").write_text(f"# written by gasloc bootstrap\n{MADDR}\n\n{MADDR}\n")
    monkeypatch.chdir(tmp_path)
    cfg = resolve(PeerConfig, flags={"network.initial_peers": ("boot.txt", MADDR)}, environ={})
    assert cfg.network.initial_peers == [MADDR]  # expanded and deduplicated
    with pytest.raises(ConfigError, match="neither a multiaddr"):
        resolve(PeerConfig, flags={"network.initial_peers": ("missing.txt",)}, environ={})
    with pytest.raises(ConfigError, match=r"must end with /p2p/<peer id>"):
        resolve(PeerConfig, flags={"network.initial_peers": ("/ip4/127.0.0.1/tcp/1",)}, environ={})


def test_cli_print_config_is_the_resolved_toml(tmp_path):
    res = CliRunner().invoke(peer_cli, ["--print-config", "--run-id", "r1", "--algorithm", "diloco",
                                        "--port", "4001", "--max-rounds", "3", "--no-checkpoint"],
                             env={"GASLOC_INNER__LR": "0.002"})
    assert res.exit_code == 0, res.output
    tree = tomllib.loads(res.output)
    assert tree["swarm"]["run_id"] == "r1"
    assert tree["outer"]["algorithm"] == "diloco"
    assert tree["network"]["port"] == 4001
    assert tree["run"]["max_rounds"] == 3
    assert tree["inner"]["lr"] == 0.002
    assert "checkpoint" not in tree  # --no-checkpoint: the section is unset
    # the printed config round-trips through --config
    f = tmp_path / "peer.toml"
    f.write_text(res.output)
    again = CliRunner().invoke(peer_cli, ["--config", str(f), "--print-config", "--no-checkpoint"], env={})
    assert again.exit_code == 0 and tomllib.loads(again.output) == tree


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    res = CliRunner().invoke(peer_cli, ["--print-config"], env={"GASLOC_SWARM__BOGUS": "1"})
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == ["Error: unknown environment variable GASLOC_SWARM__BOGUS: it names no field of this "
                     "command's config (see --print-config for the fields; sections are joined by '__')"]


def test_one_peer_per_run_directory(tmp_path):
    from gasloc.peer.daemon import lock_run_dir, worker_seed
    from gasloc.runtime.lifecycle import StartupError
    first = lock_run_dir(tmp_path / "peer")
    with pytest.raises(StartupError, match="in use by another peer"):
        lock_run_dir(tmp_path / "peer")
    first.close()  # released (as by the kernel when a killed peer's process ends)
    lock_run_dir(tmp_path / "peer").close()
    # the data-stream seed is random per directory and stable across restarts
    assert worker_seed(tmp_path / "peer") == worker_seed(tmp_path / "peer") != worker_seed(tmp_path)
