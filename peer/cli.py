"""`gasloc peer`: click -> PeerConfig -> Peer(config).run(). Hyperparameters come from the config file and GASLOC_*
variables; the flags are deployment knobs."""
from __future__ import annotations

import sys

import click


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="GASLOC_CONFIG",
              help="TOML file with PeerConfig sections ([model], [inner], [outer], [swarm], ...)")
@click.option("--print-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--initial-peers", multiple=True, metavar="MADDR|FILE",
              help="a running peer or bootstrap node (full multiaddr), or a file of them (repeatable)")
@click.option("--run-id", help="training run to join: peers of one run share its DHT key [gasloc]")
@click.option("--run-dir", type=click.Path(file_okay=False), help="metrics.jsonl and checkpoints go here "
              "[runs/<run-id>/peer]")
@click.option("--algorithm", type=click.Choice(["gasloc", "gossip", "noloco", "diloco"]),
              help="outer update: gasloc (pairwise gossip), diloco (all-reduce baseline), ... [gasloc]")
@click.option("--port", type=int, help="TCP/UDP port on every interface, 0 for any [0]")
@click.option("--host-maddrs", multiple=True, help="listen multiaddr (repeatable); overrides --port")
@click.option("--announce-maddrs", multiple=True, help="multiaddr other peers should dial (repeatable)")
@click.option("--identity-path", type=click.Path(dir_okay=False), help="key file for a stable peer id")
@click.option("--swarm-key", type=click.Path(dir_okay=False), help="swarm key file of a private swarm "
              "(gasloc keygen FILE); every peer and bootstrap of the swarm needs the same one")
@click.option("--reachability", type=click.Choice(["auto", "public", "private"]),
              help="can others dial this peer? auto: probe at start; private: behind NAT without a port forward "
              "[auto]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="training device [auto]")
@click.option("--max-rounds", type=int, help="stop after this many outer rounds [run until stopped]")
@click.option("--max-seconds", type=float, help="stop after this many seconds of training")
@click.option("--metrics-port", type=int, help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any "
              "free port) [off]")
@click.option("--no-checkpoint", is_flag=True, help="neither write checkpoints nor resume from them")
def peer(config_file, print_config, initial_peers, run_id, run_dir, algorithm, port, host_maddrs, announce_maddrs,
         identity_path, swarm_key, reachability, device, max_rounds, max_seconds, metrics_port, no_checkpoint) -> None:
    """Join a training swarm (or start one) and train until Ctrl+C or SIGTERM."""
    from gasloc.peer.config import PeerConfig
    from gasloc.runtime.config import ConfigError, dump_toml, resolve

    flags = {
        "network.initial_peers": initial_peers, "swarm.run_id": run_id, "run.run_dir": run_dir,
        "outer.algorithm": algorithm, "network.port": port, "network.host_maddrs": host_maddrs,
        "network.announce_maddrs": announce_maddrs, "network.identity_path": identity_path, "swarm.key_path": swarm_key,
        "network.reachability": reachability, "run.device": device, "run.max_rounds": max_rounds,
        "run.max_seconds": max_seconds, "metrics.port": metrics_port,
    }
    try:
        cfg = resolve(PeerConfig, config_file, flags)
    except ConfigError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    if no_checkpoint:
        cfg = cfg.model_copy(update={"checkpoint": None})
    if print_config:
        click.echo(dump_toml(cfg), nl=False)
        return

    from gasloc.runtime.logs import setup_logging
    setup_logging()
    from gasloc.peer.daemon import Peer
    from gasloc.peer.train.memory import DoesNotFit
    from gasloc.runtime.lifecycle import StartupError

    try:
        code = Peer(cfg).run()
    except StartupError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except FloatingPointError as e:  # a NaN loss with no finite checkpoint to recover from (peer/daemon.py _recover)
        click.echo(f"Error: {e} (no finite checkpoint to go back to)", err=True)
        sys.exit(1)
    except DoesNotFit as e:  # out of memory, at start or mid-run (peer/train/memory.py): exit 3, not a crash
        click.echo(f"Error: {e}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code)
