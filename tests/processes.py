"""Looking at processes through /proc, for every test that checks what lives."""

from __future__ import annotations

from pathlib import Path


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None once it is gone or a zombie
    (a zombie holds nothing: no memory, no port, no file; a container's init
    may never reap one)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]))


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None
