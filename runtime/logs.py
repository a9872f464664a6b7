"""Logging for gasloc commands: configured once, in the command, to stderr (stdout carries only the READY line)."""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Level from the argument, else GASLOC_LOG_LEVEL, else INFO; an unknown level name falls back to INFO with a
    warning rather than a traceback."""
    name = (level or os.environ.get("GASLOC_LOG_LEVEL") or "INFO").upper()
    numeric = logging.getLevelName(name)
    logging.basicConfig(stream=sys.stderr, format=FORMAT, datefmt="%H:%M:%S",
                        level=numeric if isinstance(numeric, int) else logging.INFO, force=True)
    if not isinstance(numeric, int):
        logging.getLogger(__name__).warning("unknown GASLOC_LOG_LEVEL=%s; using INFO", name)
