"""Run the rollout flow from the command line.

    python -m flows.cli                                  # the embedded demo
    python -m flows.cli --config run.yaml --num-engines 4
    python -m flows.cli --help                           # every parameter

Parameters come from a config file (YAML or JSON, the fields of
`RolloutParams`) and/or flags (one per field; flags win). They are checked
before anything starts. Without PREFECT_API_URL the run uses an ephemeral
local Prefect whose state lives in `.prefect-home/` of the repository.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from flows.settings import set_local_prefect_defaults

set_local_prefect_defaults()  # before Prefect is imported (flows.rollout below)

import yaml  # noqa: E402 - after the environment defaults above
from pydantic import ValidationError  # noqa: E402

from flows.params import RolloutParams  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.cli",
        description="Generate rollouts with engines on Ray, orchestrated by Prefect.",
    )
    parser.add_argument("--config", type=Path, help="YAML or JSON file of parameters")
    for name, field in RolloutParams.model_fields.items():
        # Values stay strings here: the model parses and checks them, so the
        # flags and the config file get the same messages.
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=name.upper(),
            help=f"{field.description or field.title or ''} (default: {field.default!r})",
        )
    return parser


def load_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SystemExit(f"error: config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise SystemExit(f"error: config file {path} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise SystemExit(f"error: config file {path} must hold a mapping of parameters")
    return values


def flag_value(name: str, raw: str) -> Any:
    """A flag's string, as the model expects it: mappings (engine_kwargs) are
    JSON/YAML; lists (stop) a JSON list, or one value; everything else stays a
    string for the model to parse."""
    if raw.lower() in ("", "none", "null"):
        return None
    origin = typing.get_origin(RolloutParams.model_fields[name].annotation)
    if origin is list and not raw.lstrip().startswith("["):
        return [raw]
    if origin in (dict, list):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise SystemExit(f"error: --{name.replace('_', '-')} is not JSON: {exc}") from exc
    return raw


def parse_params(argv: list[str] | None = None) -> RolloutParams:
    args = build_parser().parse_args(argv)
    values = load_config(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    values.update({k: flag_value(k, v) for k, v in flags.items()})
    try:
        return RolloutParams.model_validate(values)
    except ValidationError as exc:
        raise SystemExit(f"error: invalid parameters\n{exc}") from exc


def main(argv: list[str] | None = None) -> int:
    params = parse_params(argv)
    from flows.rollout import rollout  # imports Prefect: after the checks, which are instant
    from tasks.report import terminal_curves

    try:
        summary = rollout(params)
    except Exception as exc:  # noqa: BLE001 - the run's log above holds the traceback
        print(f"\nerror: the rollout run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for step in summary.training:
        print(
            f"iteration {step['iteration']}: mean reward {step['mean_reward']:.3f}; "
            f"weights synced to version {step['weight_version']} "
            f"({step['sync_bytes'] / 1e6:.1f} MB in {step['sync_seconds']:.3f} s)"
        )
    print(f"\n{summary.rows} rollouts written to {summary.output_dir}")
    if summary.curves:
        print("\n" + "\n".join(terminal_curves(summary.metrics)))
        print(f"curves: {summary.curves}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
