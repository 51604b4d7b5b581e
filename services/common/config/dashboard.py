"""The dashboard's section: where the live page of a run is served, and how often it updates."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config.base import Section


class DashboardConfig(Section):
    enabled: bool = True
    """Whether ``rlfleet up`` starts the dashboard role (``rlfleet dashboard``) with the fleet."""
    host: str = "127.0.0.1"
    """Interface the dashboard binds to; loopback by default, since the page shows prompts and
    answers (with ``api_key`` set, its data also needs the key)."""
    port: int = Field(0, ge=0, le=65535)
    """HTTP port of the page; 0 = a free port picked at start (printed, and recorded as the
    ``dashboard`` entry of ``run_dir/endpoints.json``). ``rlfleet up --dashboard-port N``."""
    refresh_s: float = Field(1.0, gt=0, le=60)
    """How often the dashboard probes the fleet and the page fetches the new state."""
    idle_after_s: float = Field(15.0, gt=0, le=3600)
    """With no reader for this long (no ``GET /api/state``: no open page), the dashboard stops
    probing the fleet and reading the run's files, so a run nobody watches pays nothing for it
    (~13% of a core on the default job otherwise); the next request refreshes first."""
    probe_timeout_s: float = Field(1.0, gt=0, le=30)
    """Deadline of one probe (a role's health check, the router's replica list, a replica's
    ``/metrics``); a role that does not answer in time is shown as down."""
    samples: int = Field(8, ge=0, le=200)
    """How many recent samples (prompt, response, score) of validation and of training the
    page shows; the trainer writes training samples to ``run_dir/train_samples.jsonl``."""
    max_points: int = Field(2000, ge=10)
    """Most points per curve sent to the page (longer runs are thinned evenly, the last kept)."""
