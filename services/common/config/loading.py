"""Loading a config: YAML file < ``RLFLEET_*`` environment < dotted command-line overrides;
and the field listing behind ``--help-config``."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from rlfleet.common.config.root import RlfleetConfig

ENV_OVERRIDES = {
    "RLFLEET_REDIS_URL": "redis_url",
    "RLFLEET_REDIS_PASSWORD": "redis_password",
    "RLFLEET_CLUSTER": "cluster",
    "RLFLEET_API_KEY": "api_key",
    "RLFLEET_RUN_DIR": "run_dir",
    "RLFLEET_MODEL_PATH": "model.path",
    "RLFLEET_ROLLOUT_BACKEND": "rollout.backend",
    "RLFLEET_ROUTER_ADDR": "endpoints.router",
    "RLFLEET_REWARD_ADDR": "endpoints.reward",
    "RLFLEET_REFCRITIC_ADDR": "endpoints.refcritic",
    "RLFLEET_TRAINER_ADDR": "endpoints.trainer",
    "RLFLEET_ENV_ADDR": "agent.address",
    "RLFLEET_ADVERTISE_HOST": "rollout.advertise_host",
}


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's numbers: digits only, no ``_`` separators and no
    base-60 (``1:30``), and ``1e-5`` is a float (YAML 1.1 wants ``1.0e-5``).

    Why: verl writes IcePop and rejection bounds as ``lower_upper`` (``0.5_5``), and YAML 1.1
    reads that unquoted as the number 0.55: a wrong bound taken in silence. Here it stays the
    text ``"0.5_5"`` that the field parses."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
ConfigLoader.add_constructor(  # decimal even with a leading 0 (YAML 1.1: 010 is octal 8)
    "tag:yaml.org,2002:int",
    lambda loader, node: int(node.value, 16 if node.value.startswith("0x") else 10),
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def read_yaml(text: str) -> Any:
    """YAML text as Python values, numbers read by YAML 1.2's rules (``ConfigLoader``)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def parse_value(text: str) -> Any:
    """Read an override value as YAML (``3``, ``true``, ``[a, b]``, ``null``) or a plain string."""
    try:
        return read_yaml(text)
    except yaml.YAMLError:
        return text


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"]["c"] = value`` for ``dotted = "a.b.c"``, creating dicts."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
    node[leaf] = value


def split_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.field=value")
    key, _, raw = item.partition("=")
    return key.strip(), parse_value(raw)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> RlfleetConfig:
    """Load YAML, apply ``RLFLEET_*`` variables, then dotted overrides, and validate."""
    tree: dict = {}
    if path is not None:
        tree = read_yaml(Path(path).read_text()) or {}
    variables = os.environ if env is None else env
    for var, dotted in ENV_OVERRIDES.items():
        if variables.get(var):
            set_dotted(tree, dotted, variables[var])
    for item in overrides or []:
        set_dotted(tree, *split_override(item))
    return RlfleetConfig.model_validate(tree)


def describe_fields(model: type[BaseModel] = RlfleetConfig, prefix: str = "") -> list[str]:
    """``dotted.name = default: docstring`` for every field, for --help-config. Sections are
    spelled out field by field, optional ones (``reward.custom``) included."""
    lines = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section_of(field.annotation)
        if section is None or field.description:
            default = "(required)" if field.is_required() else f"= {field.default!r}"
            lines.append(f"{dotted} {default}: {field.description or ''}")
        if section is not None:
            lines.extend(describe_fields(section, f"{dotted}."))
    return lines


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds, also behind ``| None``; None for plain values."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
