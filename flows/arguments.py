"""The run's parameters from the command line: the demo preset, then a
config file (YAML or JSON, in `RolloutParams`' sections), then flags (one
per field, named by the field alone, generated from the model with its
bounds in --help; the later wins). Checked before anything starts.
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from flows.params import FIELD_SECTION, RolloutParams, flag, sectioned
from flows.settings import PACKAGED_PROMPTS, PACKAGED_TASK
from tasks.run.params import DataParams

#: What `rolloutflow` runs unless told otherwise: the on-policy loop on a
#: labelled task with a verifier (the letter a prompt repeats), so the first
#: run shows a policy learning to read its prompt: the mean reward goes from
#: about 0.005 to 0.5 or more within 4 iterations. Chosen by measurement over
#: seeds (docs/reporting.md). One engine: on a small machine each engine's
#: start-up costs seconds. Applied under the user's config and flags;
#: `--plain` drops it.
DEMO_PRESET: dict[str, dict[str, Any]] = {
    "data": {"prompts_path": str(PACKAGED_TASK), "label_field": "answer", "id_field": "id"},
    "training": {"reward": "training.letter_task:reward", "iterations": 6, "learning_rate": 0.03},
    "sampling": {"n": 8, "max_tokens": 8},
    "engines": {"num_engines": 1},
}


def show(value: Any) -> str:
    return "none" if value is None or value == {} else str(value)


def field_info(name: str) -> FieldInfo:
    return RolloutParams.model_fields[FIELD_SECTION[name]].annotation.model_fields[name]


def bounds(info: FieldInfo) -> str:
    """A field's bounds as --help shows them, e.g. `1 <= x <= 256`."""
    found = {type(m).__name__: m for m in info.metadata}

    def num(kind: str, attribute: str) -> str:
        value = getattr(found[kind], attribute)
        return f"{value:g}" if isinstance(value, float) else str(value)

    low = "".join(
        f"{num(k, k.lower())} {op} " for k, op in (("Ge", "<="), ("Gt", "<")) if k in found
    )
    high = "".join(
        f" {op} {num(k, k.lower())}" for k, op in (("Le", "<="), ("Lt", "<")) if k in found
    )
    return f"; {low}x{high}" if low or high else ""


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Sectioned parameters, a later layer's field winning over an earlier's.
    A key that is not a section (a flat config) passes through: the model
    names its new place."""
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in RolloutParams.model_fields and isinstance(value, dict):
                values[key] = {**values.get(key, {}), **value}
            else:
                values[key] = value
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutflow",
        description="Generate rollouts with engines on Ray, orchestrated by Prefect. "
        "With no parameters: the demo, "
        + ", ".join(
            f"{flag(k)} {v}"
            for section in DEMO_PRESET.values()
            for k, v in section.items()
            if k != "prompts_path"
        )
        + " (the on-policy loop on the tiny model, on the packaged labelled task).",
    )
    parser.add_argument("--config", type=Path, help="YAML or JSON file of parameters")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="Without the demo preset: a plain rollout job on RolloutParams' defaults "
        "(no reward, one iteration), as a deployment runs it.",
    )
    for name, section in FIELD_SECTION.items():
        field = field_info(name)
        shown = show(field.get_default(call_default_factory=True))
        if name in DEMO_PRESET.get(section, {}):
            shown = f"{show(DEMO_PRESET[section][name])}; with --plain {shown}"
        text = f"{field.description or field.title or ''} (default: {shown}{bounds(field)})"
        if field.annotation is bool:
            parser.add_argument(
                flag(name), dest=name, action=argparse.BooleanOptionalAction, help=text
            )
            continue
        # Values stay strings here: the model parses and checks them, so the
        # flags and the config file get the same messages.
        parser.add_argument(flag(name), dest=name, metavar=name.upper(), help=text)
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


def flag_value(name: str, raw: Any) -> Any:
    """A flag's value, as the model expects it: mappings (engine_kwargs) are
    JSON/YAML; lists (stop) a JSON list, or one value; switches are booleans;
    the rest stays a string for the model to parse."""
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("", "none", "null"):
        return None
    origin = typing.get_origin(field_info(name).annotation)
    if origin is list and not raw.lstrip().startswith("["):
        return [raw]
    if origin in (dict, list):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise SystemExit(f"error: {flag(name)} is not JSON: {exc}") from exc
    return raw


def describe_errors(exc: ValidationError, flags: set[str], config: Path | None) -> str:
    """One line per error, naming what the user typed: the flag, or the
    config file's key."""
    lines = []
    for error in exc.errors():
        # A field's error is at (section, field); the model's own at ().
        field = str(error["loc"][-1]) if len(error["loc"]) == 2 else None
        if field is None:
            where = "parameters"
        elif field in flags or config is None:
            where = flag(field)
        else:
            where = f"{error['loc'][0]}.{field} in {config}"
        value = f" {error['input']!r}" if field and "input" in error else ""
        message = error["msg"].removeprefix("Value error, ")
        lines += [f"  {where}{value}: {line}" for line in message.splitlines()]
    return "error: invalid parameters\n" + "\n".join(lines)


def preset_for(given: dict[str, Any]) -> dict[str, Any]:
    """The demo preset under `given`, without what `given` leaves meaningless
    (the run's flag pairs would refuse it): an agent run's reward is its
    agent's, and a run that does not train has no step size."""
    agents, training = given.get("agents", {}), given.get("training", {})
    left_out = set()
    if agents.get("agent") or agents.get("agent_func_path"):
        left_out.add("reward")
    if training.get("train") is False:
        left_out.add("learning_rate")
    preset = DEMO_PRESET["training"]
    return {**DEMO_PRESET, "training": {k: v for k, v in preset.items() if k not in left_out}}


def parse_params(argv: list[str] | None = None) -> RolloutParams:
    args = build_parser().parse_args(argv)
    config = load_config(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "plain") and v is not None}
    given = merged(config, sectioned({k: flag_value(k, v) for k, v in flags.items()}))
    values = merged({} if args.plain else preset_for(given), given)
    data = values.get("data", {})
    if "prompts_path" not in data and not Path(DataParams().prompts_path).exists():
        # The installed command, away from a checkout: the packaged demo prompts.
        values["data"] = {**data, "prompts_path": str(PACKAGED_PROMPTS)}
    try:
        return RolloutParams.model_validate(values)
    except ValidationError as exc:
        raise SystemExit(describe_errors(exc, set(flags), args.config)) from exc
