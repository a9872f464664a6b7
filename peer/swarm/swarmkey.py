"""Reading and writing swarm key files (the format is in gasloc.protocol.auth)."""
from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from gasloc.protocol.auth import KEY_MIN_BYTES, SwarmKeyError, parse_swarm_key

log = logging.getLogger(__name__)

KEYGEN_BYTES = KEY_MIN_BYTES


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """The key in `path`; SwarmKeyError with one line when the file is missing, unreadable or weak."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="ascii")
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise SwarmKeyError(f"swarm key file {p} does not exist (make one with `gasloc keygen {p}`)") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not a text file"
        raise SwarmKeyError(f"cannot read swarm key file {p}: {why}") from None
    try:
        key = parse_swarm_key(text)
    except SwarmKeyError as e:
        raise SwarmKeyError(f"{p}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # not refused: container secrets are often mounted 0444, and the operator may have reasons
        log.warning("swarm_key_permissions path=%s mode=%o: others on this host can read it; chmod 600 %s",
                    p, stat.S_IMODE(mode), p)
    return key


def keygen(path: str | os.PathLike) -> Path:
    """Write a new random key to `path` (mode 0600, never over an existing file)."""
    p = Path(path).expanduser()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{p} already exists; a swarm key is never overwritten (remove it first)") from None
    except OSError as e:
        raise SwarmKeyError(f"cannot create swarm key file {p}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEYGEN_BYTES) + "\n")
    return p


def check_key_path(v: Path | None) -> Path | None:
    """A pydantic field validator: a set key path must hold a usable key (one-line error at config time)."""
    if v is not None:
        load_swarm_key(v)     # SwarmKeyError is a ValueError: pydantic reports it under the field's name
    return v
