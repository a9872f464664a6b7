"""`gasloc bootstrap`: click -> BootstrapConfig -> run(config)."""
from __future__ import annotations

import sys

import click


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="GASLOC_CONFIG",
              help="TOML file with BootstrapConfig keys")
@click.option("--print-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--run-id", help="run whose swarm size is logged [gasloc]")
@click.option("--port", type=int, help="TCP and UDP port on every interface, 0 for any [31337]")
@click.option("--host-maddrs", multiple=True, help="listen multiaddr (repeatable); overrides --port")
@click.option("--announce-maddrs", multiple=True, help="multiaddr peers should dial (repeatable)")
@click.option("--initial-peers", multiple=True, help="another node to join: multiaddr or file (repeatable)")
@click.option("--identity-path", type=click.Path(dir_okay=False), help="key file for a stable peer id")
@click.option("--swarm-key", "key_path", type=click.Path(dir_okay=False), help="swarm key file of a private "
              "swarm (gasloc keygen FILE)")
@click.option("--maddrs-file", type=click.Path(dir_okay=False), help="write the full multiaddrs here")
@click.option("--log-interval-s", type=float, help="log the swarm size this often [30]")
def bootstrap(config_file, print_config, **flags) -> None:
    """Run a DHT node for peers to join through; prints its multiaddrs; Ctrl+C or SIGTERM to stop."""
    from gasloc.bootstrap.config import BootstrapConfig
    from gasloc.runtime.config import resolve_for_cli
    from gasloc.runtime.logs import setup_logging

    cfg = resolve_for_cli(BootstrapConfig, config_file, flags, print_config)
    setup_logging()
    from gasloc.bootstrap.node import BootstrapError, run

    try:
        code = run(cfg)
    except BootstrapError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    sys.exit(code)
