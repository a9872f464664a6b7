"""`gasloc presets`: the model presets, their sizes and fp32 training memory."""
import click


@click.command()
def presets() -> None:
    """List model presets with parameter counts and fp32 training memory."""
    from gasloc.peer.train.model import preset_table

    click.echo("| preset | dim | layers | heads (kv) | params, byte vocab | params, 32k vocab | fp32 train GB, 32k |")
    click.echo("|---|---|---|---|---|---|---|")
    def size(n: int) -> str:
        return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.0f}k"

    for r in preset_table():
        click.echo(f"| {r['preset']} | {r['dim']} | {r['n_layers']} | {r['n_heads']} ({r['n_kv_heads']}) | "
                   f"{size(r['params_vocab256'])} | {size(r['params_vocab32000'])} | "
                   f"{r['train_mem_gb_vocab32000']} |")
