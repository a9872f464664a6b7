"""The `gasloc` command: a thin click layer. Each subcommand lives beside the component it runs, builds that
component's config (gasloc.runtime.config.resolve) and calls one `run(config)`. Subcommands load lazily, so `gasloc sim`
never imports hivemind and `gasloc --help` is fast."""
from __future__ import annotations

import atexit
import gc
import importlib

import click

from gasloc import __version__

# At exit the interpreter collects cyclic garbage among everything still alive, torch's and dynamo's modules
# included: 1.0-1.35 s of CPU in a process that imported them, 0.15 s with those objects frozen first (measured); the
# peers of a swarm that stops pay it all at once. Frozen objects are left out of those collections (the OS takes the
# memory back); atexit callbacks, flushes and the destructors of what reference counting frees run as before.
atexit.register(gc.freeze)

# name -> "module:attribute" of a click command
COMMANDS = {
    "peer": "gasloc.peer.cli:peer",
    "bootstrap": "gasloc.bootstrap.cli:bootstrap",
    "swarm": "gasloc.cli.swarm:swarm",
    "status": "gasloc.cli.status:status",
    "sim": "gasloc.sim.cli:sim",
    "doctor": "gasloc.cli.doctor:doctor",
    "export": "gasloc.peer.train.export:export",
    "tokenize": "gasloc.peer.train.tokenize_cli:tokenize",
    "presets": "gasloc.cli.presets:presets",
    "config-reference": "gasloc.cli.configref:config_reference",
    "keygen": "gasloc.cli.keygen:keygen",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gasloc")
def cli() -> None:
    """Peer-to-peer LLM pre-training with GASLoC (gossip + outer momentum) over hivemind."""


if __name__ == "__main__":  # `python -m gasloc.cli.main`: how supervisors start children with their own interpreter
    from gasloc.runtime.procs import die_with_supervisor

    die_with_supervisor()
    cli()
