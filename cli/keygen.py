"""`gasloc keygen FILE`: a new swarm key for a private swarm (give the same file to every peer and bootstrap)."""
from __future__ import annotations

import sys

import click


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
def keygen(file: str) -> None:
    """Write a new random swarm key (32 bytes as hex, mode 0600) to FILE; it is never overwritten."""
    from gasloc.peer.swarm.swarmkey import keygen as write_key
    from gasloc.protocol.auth import SwarmKeyError

    try:
        path = write_key(file)
    except SwarmKeyError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote swarm key {path}: pass it as --swarm-key to every peer and bootstrap of the swarm")
