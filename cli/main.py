"""The `gasloc` command: a thin click layer. Each subcommand builds its config and calls one `run(config)`."""
import click

from gasloc import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gasloc")
def cli() -> None:
    """Peer-to-peer LLM pre-training with GASLoC (gossip + outer momentum) over hivemind."""
