"""Shared start-up for role entry points: arguments, config, logging.

Entry points stay short and import torch/vLLM only after this returns, so
``rlfleet <verb> --help`` answers instantly.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rlfleet.common.config import RlfleetConfig, describe_fields, load_config, log_config


def base_parser(role: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"rlfleet {role}", description=description)
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--help-config", action="store_true", help="list every config field and exit"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    return parser


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def resolve(
    parser: argparse.ArgumentParser, role: str, argv: list[str] | None
) -> tuple[RlfleetConfig, argparse.Namespace]:
    """Parse args, print field docs on --help-config, load + log the config."""
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        print("\n".join(describe_fields()))
        raise SystemExit(0)
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, OSError) as exc:
        parser.error(f"bad config: {exc}")
    setup_logging(config.log_level, role)
    log_config(config, role)
    return config, args
