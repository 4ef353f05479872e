"""Looking at processes through /proc, for every test that checks what lives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Process:
    pid: int
    state: str
    parent: int
    started: int  # clock ticks since boot: a pid reused later is another process

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.started)

    def cmdline(self) -> str:
        """Its command line, or its name in brackets while it has none (as
        `ps` shows a process whose memory is already released)."""
        try:
            line = Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            return line.strip() or f"[{Path(f'/proc/{self.pid}/comm').read_text().strip()}]"
        except (FileNotFoundError, ProcessLookupError):
            return "(gone)"


def read_process(pid: int) -> Process | None:
    """None once it is gone or a zombie (a zombie holds nothing: no memory,
    no port, no file; a container's init may never reap one)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return Process(pid, fields[0], int(fields[1]), int(fields[19]))


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process; None once it is gone or a zombie."""
    process = read_process(pid)
    return None if process is None else (process.state, process.parent)


def alive(pid: int) -> bool:
    return read_process(pid) is not None
