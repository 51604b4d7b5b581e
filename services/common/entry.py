"""Shared start-up for role entry points: arguments, config, logging, the resolved config.

Entry points stay short and import torch/vLLM only after this returns, so
``rlfleet <verb> --help`` answers instantly. At start each role logs one line about its
config and writes the whole resolved config to ``run_dir/config.<role>.yaml``: the log stays
readable, and what a process actually ran with can still be looked up afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig, describe_fields, load_config

log = logging.getLogger(__name__)

SERVICE_ROLES = frozenset({"rollout", "router", "reward", "refcritic", "trainer", "env"})
"""Roles that record their resolved config; client verbs (``status``) only read one."""


def base_parser(role: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"rlfleet {role}", description=description)
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--help-config", action="store_true", help="list every config field and exit"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    return parser


CHATTY_LIBRARIES = ("asyncio", "filelock", "grpc", "httpcore", "httpx", "matplotlib", "PIL")
"""Kept at INFO under DEBUG: their own debug output (matplotlib's font search alone is ~150
lines in the trainer, grpc's a few per channel) would bury rlfleet's per-step lines."""


def setup_logging(level: str, role: str) -> None:
    """Configure the root logger; an unknown level name raises ValueError (never a default)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        for name in CHATTY_LIBRARIES:
            logging.getLogger(name).setLevel(logging.INFO)


def quiet_libraries(level: str) -> None:
    """Keep libraries' own chatter out of the fleet's output unless DEBUG is asked for: the
    Hugging Face progress bars ("Loading weights", "Writing model shards": a set per role that
    loads a model) and vLLM's INFO lines (tens per replica at start). Environment variables,
    because both libraries read them when imported (after this, in every role) and vLLM's
    engine process inherits them; one the user set is left as it is."""
    numeric = logging.getLevelName(level.upper())
    if numeric == logging.DEBUG:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(max(numeric, logging.WARNING)))


def resolve(
    parser: argparse.ArgumentParser,
    role: str,
    argv: list[str] | None,
    settle: Callable[[RlfleetConfig], RlfleetConfig] | None = None,
) -> tuple[RlfleetConfig, argparse.Namespace]:
    """Parse args, print field docs on --help-config, load the config and report it.
    ``settle`` fills in what the role decides itself (a replica's generated id) before the
    config is recorded, so the record is what the process runs with."""
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        print("\n".join(describe_fields()))
        raise SystemExit(0)
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, OSError) as exc:
        parser.error(f"bad config: {exc}")
    if settle is not None:
        config = settle(config)
    setup_logging(config.log_level, role)
    quiet_libraries(config.log_level)
    tls.use(config.tls)  # every server and client of this process
    where = record_config(config, role) if role in SERVICE_ROLES else None
    log.info("%s (resolved config: %s)", config_summary(config, role), where or "not written")
    return config, args


def config_summary(config: RlfleetConfig, role: str) -> str:
    """One line with what tells runs apart: cluster, model, Redis, run directory."""
    return (
        f"{role} config: cluster={config.cluster} model={config.model.path} "
        f"redis={safe_url(config.redis_url)} run_dir={config.run_dir} "
        f"log_level={config.log_level} api_key={'set' if config.api_key else 'none'}"
    )


def record_config(config: RlfleetConfig, role: str) -> Path | None:
    """Write the resolved config (secrets masked) to ``run_dir/config.<name>.yaml``, where a
    replica's name is its id so replicas sharing a run directory keep a file each. A run
    directory that cannot be written is a warning, not a failed start."""
    name = config.rollout.replica_id if role == "rollout" and config.rollout.replica_id else role
    path = Path(config.run_dir) / f"config.{name}.yaml"
    data = config.model_dump(mode="json")
    data["api_key"] = "***" if config.api_key else None
    data["redis_url"] = safe_url(config.redis_url) if config.redis_url else None
    data["redis_password"] = "***" if config.redis_password else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(yaml.safe_dump(data, sort_keys=False))
        partial.replace(path)  # atomic: a reader never sees half a file
    except OSError as exc:
        log.warning("could not write the resolved config to %s: %s", path, exc)
        return None
    return path


def safe_url(url: str | None) -> str:
    """``url`` without its password (Redis URLs may carry one, a socket's in its query)."""
    if not url:
        return "none"
    url = re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()
