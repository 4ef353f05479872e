"""A real multi-node Ray cluster on one machine, each node its own
`ray start --block` process (a process group of its own), running a Python
that cannot import rolloutflow: what a cluster whose image never installed
the project looks like.

The nodes' Python is a throwaway venv whose only site directory points at the
shared venv's site-packages through a plain path line. Python does not read
the `.pth` files of a directory added that way, so the editable install of
rolloutflow (a `.pth` finder) is not active there, while Ray and torch import.
Each node runs in a scratch directory, and the driver's own working
directory must not hold the project either: Ray puts it on the workers' path.

Processes are ended by their process group ids, never with `ray stop` (it
ends every Ray process of the user on the machine).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from waiting import SETUP_TIMEOUT_S

# Node death is detected by GCS health checks (by default after about 15 s);
# a test that kills a node wants to see it within a couple of seconds.
HEAD_ENV = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


ATTEMPTS = 6


def can_hide_folders() -> bool:
    """Whether nodes can get mount namespaces of their own (root, or a user
    namespace allowed)."""
    try:
        return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def python_without_rolloutflow(root: Path) -> Path:
    """A Python with the shared venv's packages but not the project."""
    venv = root / "py"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "shared-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python"


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    log: Path
    node_id: str | None = None
    killed: bool = False


class ProcessCluster:
    """`python`/`pythonpath`: the nodes' interpreter and PYTHONPATH, neither
    holding rolloutflow (default: a throwaway venv over the shared venv's
    packages, no PYTHONPATH). The GPU hosts' packages live on a PYTHONPATH."""

    def __init__(
        self,
        token: str | None = None,
        python: Path | None = None,
        pythonpath: str | None = None,
        hidden: list[Path] | None = None,
    ) -> None:
        #: With a token, every node runs with Ray's token authentication on.
        self.token = token
        #: Folders the nodes do not see (an empty tmpfs over each, in a mount
        #: namespace of their own): the driver's disk, not the nodes'.
        self.hidden = list(hidden or [])
        # Short: Ray's socket paths live under it (the limit is about 107 bytes).
        self.root = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
        self.python = python or python_without_rolloutflow(self.root)
        self.pythonpath = pythonpath
        self.port = free_port()
        self.address = f"{ray.util.get_node_ip_address()}:{self.port}"
        self.nodes: dict[str, Node] = {}

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
        env.update(
            {
                "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0",
            }
        )
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        if self.token:
            env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token})
        env.update(extra or {})
        return env

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Node:
        """Start a node and wait until `ray start` reports it up. A raylet
        gives its agents about 30 s to come up and `ray start` gives the
        raylet 30 s to register (both fixed); on a loaded machine they can take
        longer and the node aborts or hangs: it is then started again."""
        for attempt in range(ATTEMPTS):
            node = self.launch(name, args, env, attempt)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and node.process.poll() is None:
                if "Ray runtime started" in node.log.read_text():
                    return node
                time.sleep(0.2)
            self.kill(name)
        raise RuntimeError(
            f"node {name} did not start in {ATTEMPTS} attempts:\n{node.log.read_text()[-3000:]}"
        )

    def launch(self, name: str, args: list[str], env: dict[str, str] | None, attempt: int) -> Node:
        workdir = self.root / f"{name}-{attempt}"
        workdir.mkdir()
        log = workdir / "ray-start.log"
        ports = [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        command = [str(self.python), "-m", "ray.scripts.scripts", "start", "--block"]
        command.append("--include-log-monitor=false")  # one process less per node
        if self.hidden:
            mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(d))}" for d in self.hidden)
            shell = ["sh", "-c", f'{mounts} && exec "$@"', "sh"]
            command = ["unshare", "--mount", "--propagation", "private", *shell, *command]
        process = subprocess.Popen(
            command + ports + args,
            cwd=workdir,
            env=self.env(env),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as a whole
        )
        node = Node(name, process, log)
        self.nodes[name] = node
        return node

    def start_head(self, num_cpus: int = 0, num_gpus: int = 0, env: dict | None = None) -> Node:
        return self.start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--ray-client-server-port={free_port()}",
                f"--temp-dir={self.root / 'ray'}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--num-cpus={num_cpus}",
                f"--num-gpus={num_gpus}",
            ],
            {**HEAD_ENV, **(env or {})},
        )

    def add_worker(
        self,
        name: str,
        num_cpus: int,
        resources: dict[str, float],
        num_gpus: int = 0,
        env: dict | None = None,
    ) -> Node:
        return self.start(
            name,
            [
                f"--address={self.address}",
                f"--num-cpus={num_cpus}",
                f"--num-gpus={num_gpus}",
                f"--resources={json.dumps(resources)}",
            ],
            env,
        )

    def wait_for_nodes(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait (connected as a driver) until every started node not killed is
        alive, and no other; record each worker's node id by its custom resource."""
        nodes = {name: node for name, node in self.nodes.items() if not node.killed}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in nodes.values():
                if node.process.poll() is not None:
                    raise RuntimeError(f"node {node.name} exited:\n{node.log.read_text()[-3000:]}")
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) == len(nodes):
                for info in alive:
                    for name in nodes:
                        if name in info["Resources"]:
                            self.nodes[name].node_id = info["NodeID"]
                return
            time.sleep(0.2)
        raise AssertionError(f"{len(nodes)} Ray nodes not alive within {timeout_s}s")

    def kill(self, name: str) -> None:
        """Remove a node as a crash would: SIGKILL to its whole process group."""
        node = self.nodes[name]
        node.killed = True
        try:
            os.killpg(node.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.process.wait(timeout=30)

    def shutdown(self) -> None:
        """End every node: SIGTERM to its process group, SIGKILL to what is
        left; then remove the cluster's folder (a failed start's error quoted
        the log it needed)."""
        for node in self.nodes.values():
            try:
                os.killpg(node.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        # One deadline for all: `ray start --block` may sit out a SIGTERM,
        # and waiting for each node in turn added up to a minute.
        deadline = time.monotonic() + 10
        for node in self.nodes.values():
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # raylets and workers left in the group
                os.killpg(node.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
