"""Time from the command to the first row on disk, and to the end, of the
CLI's default run (what `make run` starts), with where the time goes. Not a
test: it reports numbers.

    python benchmarks/first_row.py [--repeats 3] [--compare CHECKOUT] [--fresh-home]
        [-- CLI ARGS...]

With --compare, the CLI of another checkout (e.g. `git worktree add /tmp/base
main`) runs too, alternating with this one, so that both see the same load;
the table then puts them side by side with their ratio. The load average
(`uptime`'s) is printed before each run: on a shared box the figures mean
little without it.

Each repeat runs `python -m flows.cli` as a user would (its own local Ray and
Prefect server). Prefect home: by default one per checkout, its database
created before the first timed run (as a checkout's `.prefect-home` after
its first run); with --fresh-home an empty one per run (a first run, which
creates the database: Prefect's migrations, ~15 CPU seconds here).

The breakdown comes from the CLI's start-up line and the run's log
timestamps: Ray up, Prefect server up, the flow's first log line,
engines ready, the policy up, first row on disk, end. Then the CPU seconds each process of
the run used (the CLI, its Prefect server, Ray's own processes, each actor
kind), read from /proc every quarter second: unlike the wall times these
hardly depend on the box's load, and on 2 cores their sum bounds the run's
wall time from below (sum / 2); so does the sum up to the first row bound
the first row.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flows.lifetime import descendants  # noqa: E402 - after the path above

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

#: (phase, pattern of the log line that ends it)
MARKS = [
    ("flow started", re.compile(r"Beginning flow run")),
    ("engines ready", re.compile(r"engines ready")),
    ("policy up", re.compile(r"policy up")),
]
LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \|")


def first_row(out: Path) -> bool:
    return any(p.stat().st_size > 0 for p in out.glob("*/iter-000/shard-*"))


def role(pid: int) -> str | None:
    """What a process of the run is, from its command line (a Ray worker's
    title names its actor class: `ray::HFEngine.generate_text`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    line = b" ".join(argv).decode(errors="replace").strip()
    if not line:  # a zombie's: it keeps the role it had
        return None
    if line.startswith("ray::"):
        return "ray " + line.split()[0].removeprefix("ray::").split(".")[0]
    for needle, name in [
        ("uvicorn", "prefect server"),
        ("gcs_server", "ray gcs"),
        ("raylet/raylet", "ray raylet"),
        ("dashboard.py", "ray dashboard head"),
        ("log_monitor.py", "ray log monitor"),
        ("autoscaler/_private/monitor.py", "ray monitor"),
        ("-S -c", "cli's reaper"),
        ("default_worker.py", "ray worker (starting)"),
    ]:
        if needle in line:
            return name
    return "other"


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def sample_cpu(root: int, seen: dict[int, tuple[str, float]]) -> None:
    """The latest role and CPU seconds of `root` and every process under it."""
    for pid in [root, *descendants(root)]:
        name = "cli (driver)" if pid == root else role(pid)
        used = cpu_seconds(pid)
        if name is not None and used is not None:
            if name == "ray worker (starting)" and pid in seen:
                name = seen[pid][0]  # a worker's title comes after its start
            seen[pid] = (name, used)


def clock(line: str, day: datetime) -> float | None:
    match = LOG_TIME.match(line)
    if not match:
        return None
    t = datetime.strptime(match.group(1), "%H:%M:%S.%f").time()
    return datetime.combine(day.date(), t).timestamp()


def one_run(repo: Path, cli_args: list[str], prefect_home: Path, work: Path) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="out-", dir=work))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env |= {"PREFECT_HOME": str(prefect_home), "RAY_AUTH_MODE": "disabled"}
    log_path = out / "cli.log"
    wall0, t0 = time.time(), time.monotonic()
    with log_path.open("w") as log:
        cli = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "--output-dir", str(out / "runs"), *cli_args],
            cwd=repo,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        row_s = None
        seen: dict[int, tuple[str, float]] = {}
        before_row = 0.0
        sampled = 0.0
        while cli.poll() is None:
            if row_s is None and first_row(out / "runs"):
                row_s = time.monotonic() - t0
                sample_cpu(cli.pid, seen)
                before_row = sum(used for _, used in seen.values())
            if time.monotonic() - sampled > 0.25:
                sample_cpu(cli.pid, seen)
                sampled = time.monotonic()
            time.sleep(0.02)
    end_s = time.monotonic() - t0
    text = log_path.read_text()
    if cli.returncode != 0:
        # On a loaded box a local Ray can miss its start-up deadline: counted, not fatal.
        print(f"the CLI failed ({cli.returncode}):\n{text[-1500:]}", flush=True)
        return {}
    figures = {"first row": row_s or end_s, "end": end_s}
    for name, used in seen.values():
        figures[f"cpu: {name}"] = figures.get(f"cpu: {name}", 0.0) + used
    figures["cpu: all"] = sum(used for _, used in seen.values())
    # On 2 cores the first row can come no sooner than half of this.
    figures["cpu: all, before the first row"] = before_row
    if m := re.search(r"started here in ([\d.]+) s", text):
        figures["ray up"] = float(m.group(1))
    if m := re.search(r"ready after ([\d.]+) s", text):
        figures["prefect up"] = float(m.group(1))
    day = datetime.fromtimestamp(wall0)
    for name, pattern in MARKS:
        for line in text.splitlines():
            if pattern.search(line) and (at := clock(line, day)) is not None:
                figures[name] = at - wall0
                break
    return figures


ORDER = ["ray up", "prefect up", "flow started", "engines ready", "policy up", "first row", "end"]


def prepare_home(home: Path) -> None:
    """Create the Prefect database of `home`, untimed."""
    subprocess.run(
        [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
        env={**os.environ, "PREFECT_HOME": str(home)},
        check=True,
        capture_output=True,
        timeout=600,
    )


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", type=Path, help="another checkout, run alternately")
    parser.add_argument(
        "--fresh-home", action="store_true", help="an empty Prefect home for each run"
    )
    parser.add_argument("cli_args", nargs="*", help="after --: arguments of the CLI")
    args = parser.parse_args()
    # The runs' logs, outputs and Prefect homes: what is kept is the table.
    with tempfile.TemporaryDirectory(prefix="first-row-") as work:
        compare(args, Path(work))


def compare(args: argparse.Namespace, work: Path) -> None:
    checkouts = {"this": REPO} | ({"compare": args.compare.resolve()} if args.compare else {})
    homes = {name: Path(tempfile.mkdtemp(prefix="prefect-", dir=work)) for name in checkouts}
    if not args.fresh_home:
        for home in homes.values():
            prepare_home(home)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for i in range(args.repeats):
        for name, repo in checkouts.items():
            home = Path(tempfile.mkdtemp(prefix="prefect-", dir=work)) if args.fresh_home else None
            before = load()
            runs[name].append(one_run(repo, args.cli_args, home or homes[name], work))
            figures = ", ".join(
                f"{k} {v:.1f} s" for k, v in runs[name][-1].items() if not k.startswith("cpu")
            )
            print(f"run {i} ({name}: {repo}), load {before} -> {load()}: {figures}", flush=True)
    print(f"\n{os.cpu_count()} CPUs, load average now {load()}")
    for name, rs in runs.items():
        if failed := sum(not r for r in rs):
            print(f"{name}: {failed} of {len(rs)} runs failed (left out below)")
    print(f"CLI args: {' '.join(args.cli_args) or '(none: the demo)'}")
    print(
        "Prefect home:", "a fresh one per run" if args.fresh_home else "one per checkout, created"
    )
    header = f"{'median seconds from the command':<32}" + "".join(f"{n:>9}" for n in checkouts)
    print(header + (f"{'ratio':>8}" if args.compare else ""))
    cpu = sorted({k for rs in runs.values() for r in rs for k in r if k.startswith("cpu")})
    for phase in ORDER + cpu:
        medians = [
            statistics.median(values) if (values := [r[phase] for r in rs if phase in r]) else None
            for rs in runs.values()
        ]
        if all(m is None for m in medians):
            continue
        line = f"{phase:<32}" + "".join(
            f"{m:9.1f}" if m is not None else f"{'':>9}" for m in medians
        )
        if args.compare and None not in medians:
            line += f"{medians[0] / medians[1]:8.2f}"
        print(line)


if __name__ == "__main__":
    main()
