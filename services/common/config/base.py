"""The base of every config section, and where shipped defaults are found."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

SOURCE_ROOT = Path(__file__).resolve().parents[3]
"""The folder that holds the rlfleet package (``services/``): the repository in a source
checkout, which is where the default model (``models/``) and data (``data/``) ship."""

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def shipped_path(path: str) -> str:
    """``path`` itself when it is absolute or exists from here; else the same relative path
    under ``SOURCE_ROOT`` when it exists there. Why: the defaults are relative to the
    repository, so a role started from another directory would miss them, and transformers
    would take the missing folder for a Hub model id and report a network error."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return path
    shipped = SOURCE_ROOT / given
    return str(shipped) if shipped.exists() else path


class Section(BaseModel):
    """Base: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
