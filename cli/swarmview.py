"""What `gasloc swarm` shows: per-peer state from each peer's metrics.jsonl (tailed), the live table, the final
summary and the loss-against-time PNG. No processes here: see gasloc.cli.swarm for those."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gasloc.runtime.jsonl import parse_jsonl


class JsonlTail:
    """New complete records of a JSON-lines file another process appends to; a partial last line waits."""

    def __init__(self, path: Path):
        self.path, self._offset, self._partial = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return parse_jsonl(lines)


@dataclass
class PeerView:
    name: str
    peer_id: str | None = None
    status: str = "starting"  # starting | running | exited N | stopped
    round: int = 0
    loss: float | None = None
    first_loss: float | None = None
    val_loss: float | None = None
    best_val_loss: float | None = None
    exchanges_ok: int = 0
    rounds_done: int = 0
    last_partner: str | None = None
    last_outcome: str | None = None
    partners: set[str] = field(default_factory=set)
    curve: list[tuple[float, float]] = field(default_factory=list)  # (unix time, train loss)
    val_curve: list[tuple[float, float]] = field(default_factory=list)

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("event") == "start" and self.first_loss is None:
            self.first_loss = rec.get("initial_loss")
            if self.first_loss is not None and rec.get("time") is not None:
                self.curve.append((rec["time"], self.first_loss))
        if rec.get("event") != "round":
            return
        self.round = int(rec.get("round") or self.round)
        self.rounds_done += 1
        loss, val, t = rec.get("loss"), rec.get("val_loss"), rec.get("time")
        if loss is not None:
            self.loss = loss
            if self.first_loss is None:
                self.first_loss = loss
            if t is not None:
                self.curve.append((t, loss))
        if val is not None:
            self.val_loss = val
            self.best_val_loss = val if self.best_val_loss is None else min(self.best_val_loss, val)
            if t is not None:
                self.val_curve.append((t, val))
        self.last_outcome = rec.get("outcome")
        if rec.get("outcome") == "ok":
            self.exchanges_ok += 1
        if rec.get("partner"):
            self.last_partner = rec["partner"]
            self.partners.add(rec["partner"])


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def short_id(peer_id: str | None, names: dict[str, str]) -> str:
    if not peer_id:
        return "-"
    return names.get(peer_id) or f"{peer_id[:6]}…{peer_id[-4:]}"


def live_table(views: list[PeerView], elapsed_s: float, title: str):
    from rich.table import Table

    names = {v.peer_id: v.name for v in views if v.peer_id}
    t = Table(title=f"{title}   t={elapsed_s:.0f}s", title_justify="left")
    for col in ("peer", "status", "round", "loss", "val loss", "exchanges ok", "last partner", "outcome"):
        t.add_column(col, justify="right" if col in ("round", "loss", "val loss", "exchanges ok") else "left")
    for v in views:
        t.add_row(v.name, v.status, str(v.round), _fmt(v.loss), _fmt(v.val_loss), str(v.exchanges_ok),
                  short_id(v.last_partner, names), v.last_outcome or "-")
    return t


def summary_table(views: list[PeerView]):
    from rich.table import Table

    names = {v.peer_id: v.name for v in views if v.peer_id}
    t = Table(title="summary", title_justify="left")
    for col in ("peer", "status", "rounds", "first loss", "last loss", "best val loss", "exchanges ok",
                "partners"):
        t.add_column(col)
    for v in views:
        partners = ", ".join(sorted(short_id(p, names) for p in v.partners)) or "-"
        t.add_row(v.name, v.status, str(v.round), _fmt(v.first_loss), _fmt(v.loss), _fmt(v.best_val_loss),
                  f"{v.exchanges_ok}/{v.rounds_done}", partners)
    return t


def summary_dict(views: list[PeerView]) -> dict[str, Any]:
    names = {v.peer_id: v.name for v in views if v.peer_id}
    return {v.name: {"peer_id": v.peer_id, "status": v.status, "rounds": v.round, "first_loss": v.first_loss,
                     "last_loss": v.loss, "best_val_loss": v.best_val_loss, "exchanges_ok": v.exchanges_ok,
                     "rounds_recorded": v.rounds_done,
                     "partners": sorted(short_id(p, names) for p in v.partners)} for v in views}


def plot_losses(views: list[PeerView], path: Path, title: str) -> bool:
    """Train loss (lines, from the initial loss) and validation loss (dots) against seconds since the first peer
    started; False if no peer reported a loss (the PNG is still written, with a note, so it always exists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    t0 = min((v.curve[0][0] for v in views if v.curve), default=0.0)
    any_data = False
    for v in views:
        if v.curve:
            any_data = True
            line, = ax.plot([t - t0 for t, _ in v.curve], [l for _, l in v.curve], label=f"{v.name} train")
            if v.val_curve:
                ax.plot([t - t0 for t, _ in v.val_curve], [l for _, l in v.val_curve], "o", color=line.get_color(),
                        label=f"{v.name} val")
    if not any_data:
        ax.text(0.5, 0.5, "no round finished", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    if any_data:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return any_data
