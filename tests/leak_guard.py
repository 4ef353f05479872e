"""The leak guard: after each test module, no Ray actor, placement group or
process the module started is left (the teardown error names the module and
each thing left).

What a module started is what appeared between its start and its end, less
what session fixtures started meanwhile (`session_owned`: they live until the
session ends by design). Processes are this test process's: every process it
starts inherits `TOKEN_ENV`, which holds the pid of each pytest process above
it, so a daemon reparented to init is still found, and two xdist workers (or a
pytest run inside a test) each see their own. A process started under one that
was already there (a Ray worker under the session's raylet) is that parent's
business: a leaked actor is found as an actor, not as its worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from processes import Process, read_process

TOKEN_ENV = "ROLLOUTFLOW_TEST_PIDS"
os.environ[TOKEN_ENV] = ":".join(filter(None, [os.environ.get(TOKEN_ENV), str(os.getpid())]))
MY_TOKEN = str(os.getpid())

# Actor death and a process's exit after its parent's teardown are
# asynchronous; a loaded 2-core box has taken tens of seconds for them.
LEAK_DEADLINE_S = 120.0


def marked(pid: int) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    for entry in environ.split(b"\0"):
        if entry.startswith(TOKEN_ENV.encode() + b"="):
            return MY_TOKEN in entry.split(b"=", 1)[1].decode().split(":")
    return False


def my_processes() -> dict[int, Process]:
    """Every live process this test process started, by pid."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and marked(int(entry.name)):
            process = read_process(int(entry.name))
            if process is not None:
                found[process.pid] = process
    return found


@dataclass(frozen=True)
class Actor:
    description: str
    pid: int


def ray_actors() -> dict[str, Actor]:
    """Actors not dead in the connected Ray cluster, by id."""
    import ray
    from ray._private import state  # the GCS's tables: no dashboard needed

    if not ray.is_initialized():
        return {}
    return {
        actor_id: Actor(
            f"actor {info['ActorClassName']} {info['Name']!r} (pid {info['Pid']}, {info['State']})",
            info["Pid"],
        )
        for actor_id, info in state.actors().items()
        if info["State"] != "DEAD"
    }


def ray_groups() -> dict[str, str]:
    """Placement groups not removed in the connected Ray cluster."""
    import ray

    if not ray.is_initialized():
        return {}
    return {
        group_id: f"placement group {group_id} {info['name']!r} bundles "
        f"{list(info['bundles'].values())} ({info['state']})"
        for group_id, info in ray.util.placement_group_table().items()
        if info["state"] != "REMOVED"
    }


def ray_tasks() -> dict[str, str]:
    """Tasks (not actor methods) submitted and not finished in the connected
    Ray cluster: each holds a CPU while it runs, and one left running by a
    test holds it into the next module's."""
    import ray
    from ray._private import state
    from ray.core.generated.common_pb2 import TaskStatus, TaskType

    if not ray.is_initialized():
        return {}
    tasks: dict[str, dict] = {}
    for event in state.state._get_all_task_events():  # the GCS's, per state change
        task = tasks.setdefault(f"{event.task_id.hex()}-{event.attempt_number}", {"states": set()})
        if event.HasField("task_info"):
            task["name"] = event.task_info.name
            task["normal"] = event.task_info.type == TaskType.NORMAL_TASK
        if event.HasField("state_updates"):
            task["states"] |= set(event.state_updates.state_ts_ns)
            if event.state_updates.HasField("worker_pid"):
                task["pid"] = event.state_updates.worker_pid
    ended = {TaskStatus.FINISHED, TaskStatus.FAILED}
    return {
        task_id: f"task {task['name']} (pid {task.get('pid', '-')}, "
        + ("running)" if TaskStatus.RUNNING in task["states"] else "waiting)")
        for task_id, task in tasks.items()
        if task.get("normal") and not task["states"] & ended
    }


@dataclass
class Snapshot:
    processes: set[tuple[int, int]] = field(default_factory=set)
    actors: set[str] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    tasks: set[str] = field(default_factory=set)

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            {p.key for p in my_processes().values()},
            set(ray_actors()),
            set(ray_groups()),
            set(ray_tasks()),
        )

    def add(self, other: Snapshot) -> None:
        self.processes |= other.processes
        self.actors |= other.actors
        self.groups |= other.groups
        self.tasks |= other.tasks

    def minus(self, other: Snapshot) -> Snapshot:
        return Snapshot(
            self.processes - other.processes,
            self.actors - other.actors,
            self.groups - other.groups,
            self.tasks - other.tasks,
        )


@dataclass
class Leftovers:
    actors: dict[str, Actor]
    groups: dict[str, str]
    tasks: dict[str, str]
    processes: list[Process]

    def __bool__(self) -> bool:
        return bool(self.actors or self.groups or self.tasks or self.processes)

    def describe(self) -> list[str]:
        return [
            *(actor.description for actor in self.actors.values()),
            *self.groups.values(),
            *self.tasks.values(),
            *(f"process {p.pid}: {p.cmdline()[:200]}" for p in self.processes),
        ]

    def end(self) -> None:
        """End what was left, so that one module's leak is not the next one's."""
        import ray
        from ray.util.placement_group import PlacementGroup

        for group_id in self.groups:
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
        actor_pids = [actor.pid for actor in self.actors.values() if actor.pid]
        for pid in actor_pids + [p.pid for p in self.processes if same(read_process(p.pid), p)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def same(now: Process | None, then: Process) -> bool:
    return now is not None and now.key == then.key


class LeakGuard:
    def __init__(self) -> None:
        self.session = Snapshot()
        self.module_start = Snapshot()
        self.deadline_s = LEAK_DEADLINE_S

    @contextmanager
    def session_owned(self) -> Iterator[None]:
        """What appears while this runs lives for the session: not a leak."""
        before = Snapshot.take()
        try:
            yield
        finally:
            after = Snapshot.take()
            self.session.add(after.minus(before))

    def start_module(self) -> None:
        self.module_start = Snapshot.take()

    def leftovers(self) -> Leftovers:
        kept = Snapshot()
        kept.add(self.module_start)
        kept.add(self.session)
        processes = my_processes()
        new = {pid: p for pid, p in processes.items() if p.key not in kept.processes}

        def started_here(process: Process) -> bool:
            # Up through the module's new processes: ending at a process that
            # was already there means that process started it.
            while process.pid in new:
                parent = processes.get(process.parent)
                if parent is None:  # pytest itself, or init after a reparenting
                    return True
                process = parent
            return False

        return Leftovers(
            {k: v for k, v in ray_actors().items() if k not in kept.actors},
            {k: v for k, v in ray_groups().items() if k not in kept.groups},
            {k: v for k, v in ray_tasks().items() if k not in kept.tasks},
            sorted((p for p in new.values() if started_here(p)), key=lambda p: p.pid),
        )

    def check(self, module: str) -> None:
        deadline = time.monotonic() + self.deadline_s
        while left := self.leftovers():
            if time.monotonic() > deadline:
                # Described before they are ended: a killed process's command
                # line is gone while it waits to be reaped.
                described = "\n  ".join(left.describe())
                left.end()
                pytest.fail(
                    f"{module} left behind (after {self.deadline_s:g}s):\n  {described}",
                    pytrace=False,
                )
            time.sleep(0.2)


GUARD = LeakGuard()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope != "session":
        return (yield)
    with GUARD.session_owned():
        return (yield)


@pytest.fixture(scope="module", autouse=True)
def _leak_guard(request):
    GUARD.start_module()
    yield
    GUARD.check(request.module.__name__)
