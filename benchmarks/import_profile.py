"""Where an import's seconds go, for the imports a start-up compares: plain's
`import vllm` and the `vllm.LLM` it then builds, our engine actor's side of
vLLM and the engine core's modules its forkserver imports beside it
(`engines/vllm/engine.py`). Each statement runs in a fresh process under
`python -X importtime`; printed per statement: its wall time, the modules it
imported, the packages that took the most time of their own, and what ours
imports that plain's `vllm.LLM` does not. Not a test: on the GPU host, where
vLLM is installed (`tests/gpu/README.md`).

    python3 benchmarks/import_profile.py --json $OUT/imports.json
    python3 benchmarks/import_profile.py --target "t=import transformers"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: What the start-up benchmark's two sides import. `vllm.LLM` is imported on
#: first use, as is our actor's vLLM (`vllm_api()`, which the actor's
#: `__init__` calls). The forkserver's modules are
#: `engines.vllm.engine.ENGINE_CORE_MODULES`, written out so that this script
#: imports nothing of the project before it profiles it.
TARGETS = {
    "plain: import vllm": "import vllm",
    "plain: vllm.LLM": "import vllm; vllm.LLM",
    "ours: the actor": "import engines.vllm.engine; engines.vllm.engine.vllm_api()",
    "ours: the forkserver": "import vllm.v1.engine.core, vllm.v1.executor.uniproc_executor, "
    "vllm.v1.worker.gpu_worker",
}
#: Which of them ours is held against in the "ours, not plain" lines.
PLAIN = "plain: vllm.LLM"

#: `import time:       self [us] |  cumulative | imported package`
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)$")


@dataclass(frozen=True)
class Module:
    name: str
    self_s: float
    cumulative_s: float
    depth: int  # 0: imported by the statement itself


@dataclass(frozen=True)
class Profile:
    target: str
    statement: str
    wall_s: float
    modules: list[Module]

    def by_package(self, names: set[str] | None = None) -> Counter:
        """Seconds of own time per top-level package (of `names` only, if given)."""
        seconds: Counter = Counter()
        for module in self.modules:
            if names is None or module.name in names:
                seconds[module.name.split(".")[0]] += module.self_s
        return seconds


def parse(stderr: str) -> list[Module]:
    modules = []
    for line in stderr.splitlines():
        match = LINE.match(line)
        if match:
            own, cumulative, indent, name = match.groups()
            depth = (len(indent) - 1) // 2
            modules.append(Module(name, int(own) / 1e6, int(cumulative) / 1e6, depth))
    return modules


def profile(target: str, statement: str, timeout_s: float) -> Profile:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    }
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        tail = "\n".join(line for line in done.stderr.splitlines() if not LINE.match(line))[-2000:]
        raise SystemExit(f"error: {target!r} ({statement}) failed:\n{tail}")
    return Profile(target, statement, wall, parse(done.stderr))


def report(profiles: list[Profile], top: int) -> list[str]:
    lines = []
    plain = next((p for p in profiles if p.target == PLAIN), None)
    for p in profiles:
        own = sum(m.self_s for m in p.modules)
        lines.append(
            f"{p.target} ({p.statement}): {p.wall_s:.2f} s wall, {len(p.modules)} modules, "
            f"{own:.2f} s importing"
        )
        packages = ", ".join(f"{name} {s:.2f}" for name, s in p.by_package().most_common(top))
        lines.append(f"  own time by package (s): {packages}")
        slowest = sorted(p.modules, key=lambda m: m.self_s, reverse=True)[:top]
        lines.append(
            "  slowest modules, own (s): " + ", ".join(f"{m.name} {m.self_s:.2f}" for m in slowest)
        )
        if plain is not None and p.target.startswith("ours"):
            extra = {m.name for m in p.modules} - {m.name for m in plain.modules}
            seconds = p.by_package(extra)
            lines.append(
                f"  not in {PLAIN}: {len(extra)} modules, {sum(seconds.values()):.2f} s: "
                + ", ".join(f"{name} {s:.2f}" for name, s in seconds.most_common(top))
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target",
        action="append",
        metavar="NAME=STATEMENT",
        help="a statement to profile (repeatable; default: the start-up's four)",
    )
    parser.add_argument("--top", type=int, default=12, help="packages and modules listed")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a statement may take")
    parser.add_argument("--json", type=Path, help="also write every module's times here")
    args = parser.parse_args(argv)
    targets = TARGETS
    if args.target:
        bad = [t for t in args.target if "=" not in t or not t.split("=", 1)[1]]
        if bad:
            parser.error(f"--target {bad[0]!r}: expected NAME=STATEMENT")
        targets = dict(t.split("=", 1) for t in args.target)
    profiles = []
    for target, statement in targets.items():
        profiles.append(profile(target, statement, args.timeout))
        if args.json:  # after each: a call cut short keeps what it measured
            args.json.write_text(json.dumps([asdict(p) for p in profiles]))
    for line in report(profiles, args.top):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
