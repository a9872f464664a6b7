"""Start-up errors and shutdown steps: the two halves of a component's declared failure semantics.

A start-up failure the user can fix (a busy run directory, unreachable initial peers) is a StartupError whose
message is one line; the command prints it and exits 1, never a traceback. Shutdown runs a list of steps, and one
that fails must not keep the others (and so every child process) from running.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The component cannot start (network, run directory, data, ...). The message is one line for the user."""


def shutdown_step(name: str, fn: Callable[[], object]) -> None:
    """Run one shutdown step; a failure is logged and the remaining steps still run (every child must go)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must continue past any one failure
        log.warning("shutdown_step_failed step=%s error=%s: %s", name, type(e).__name__, e)
