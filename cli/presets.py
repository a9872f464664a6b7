"""`gasloc presets`: the model presets, their sizes and a round's peak memory (measured parameter copies)."""
import click


@click.command()
def presets() -> None:
    """List model presets with parameter counts and a round's peak memory (the measured parameter copies)."""
    from gasloc.peer.train.model import MEASURED_ROUND_COPIES, preset_table

    click.echo("| preset | dim | layers | heads (kv) | params, byte vocab | params, 32k vocab | "
               f"round peak GB, 32k ({MEASURED_ROUND_COPIES:g} copies) |")
    click.echo("|---|---|---|---|---|---|---|")
    def size(n: int) -> str:
        return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.0f}k"

    for r in preset_table():
        click.echo(f"| {r['preset']} | {r['dim']} | {r['n_layers']} | {r['n_heads']} ({r['n_kv_heads']}) | "
                   f"{size(r['params_vocab256'])} | {size(r['params_vocab32000'])} | "
                   f"{r['train_mem_gb_vocab32000']} |")
