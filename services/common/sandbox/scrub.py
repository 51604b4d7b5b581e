"""Take the service's secrets out of whatever text a sandbox sends back to a caller.

Why, with the environment scrubbed and /proc private already: where the kernel offers no pid
namespace (``isolation`` falls back) a child can still read the service's argv from /proc, and
anything it learns it can put into an exception message that travels back in the item's
``error``. So every text that comes out of a sandbox (errors, program output, replies) passes
through ``scrub``: each secret of this process becomes ``[redacted]``. The secrets are the
values of environment variables and ``name=value`` / ``--name value`` arguments whose names
have a word that says so (``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``, ``CREDENTIALS``,
``AUTH``: ``RLFLEET_API_KEY``, ``api_key``, ``HF_TOKEN``, but not ``TOKENIZERS_PARALLELISM``),
URLs that carry a password, and whatever ``add_secret`` was given.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

SECRET_NAME = re.compile(
    r"(^|[_.-])(api_?key|key|token|secret|password|passwd|pass|credentials?|auth)([_.-]|$)",
    re.IGNORECASE,
)
URL_WITH_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]+@", re.IGNORECASE)
REDACTED = "[redacted]"
MIN_LENGTH = 6  # shorter values ("1", "false") would redact ordinary words
_added: set[str] = set()


def add_secret(value: str | None) -> None:
    """One more value never to hand back (say, an API key that came from a config file)."""
    if value:
        _added.add(value)


def secrets() -> set[str]:
    """This process's secret values, read now (the environment may have changed)."""
    found = set(_added)
    for name, value in os.environ.items():
        if SECRET_NAME.search(name) or URL_WITH_PASSWORD.match(value):
            found.add(value)
    found |= _argv_secrets(sys.argv)
    return {value for value in found if len(value) >= MIN_LENGTH}


def _argv_secrets(argv: list[str]) -> set[str]:
    found = set()
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        leaf = name.lstrip("-").rsplit(".", 1)[-1]
        if equals and SECRET_NAME.search(leaf):
            found.add(value)
        elif not equals and arg.startswith("--") and SECRET_NAME.search(leaf) and i + 1 < len(argv):
            found.add(argv[i + 1])
        if URL_WITH_PASSWORD.match(value or arg):
            found.add(value or arg)
    return found


def scrub(text: str, values: list[str] | None = None) -> str:
    """``text`` with every secret replaced (longest first, so one inside another goes whole)."""
    for value in _longest_first() if values is None else values:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def scrub_tree(value: Any, values: list[str] | None = None) -> Any:
    """``scrub`` applied to every string in a decoded JSON value (keys too)."""
    values = _longest_first() if values is None else values
    if isinstance(value, str):
        return scrub(value, values)
    if isinstance(value, list):
        return [scrub_tree(item, values) for item in value]
    if isinstance(value, dict):
        return {scrub(str(key), values): scrub_tree(item, values) for key, item in value.items()}
    return value


def _longest_first() -> list[str]:
    return sorted(secrets(), key=len, reverse=True)
