"""Reading the kernel's text files: a missing or unreadable file is ``None``, never an exception."""

from __future__ import annotations

import re
from pathlib import Path

NOT_FOUND = "not found"


def read_text(path: Path) -> str | None:
    """The stripped text of ``path``, or ``None`` when it cannot be read (absent, EINVAL, ...)."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def kib_field(text: str, name: str) -> int | None:
    """A ``NAME:  N kB`` field of a meminfo file, in bytes (``None`` when absent)."""
    match = re.search(rf"^(?:Node \d+ )?{name}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None
