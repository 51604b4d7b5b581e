"""Request and reply shapes of other RL frameworks' remote reward calls, as plain functions.

- OpenRLHF (``--remote_rm_url``): ``POST /get_reward`` with ``{"query": [...], "prompts":
  [...], "labels": [...]}``; ``query`` is prompt + response, so the response is what follows
  the prompt. Reply ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``, where
  ``extra_logs`` holds one list per metric (and ``reward_error``: 1.0 where an item could not
  be scored, its reward then ``reward.default_score``): OpenRLHF averages and logs them.
- slime (``--rm-type remote_rm``): ``POST /slime/reward`` with ``{"prompt", "response",
  "label"}``; the reply is the bare float slime takes as the reward, or with ``?detail=true``
  ``{"score": ..., "metrics": {...}}`` (for slime's ``--reward-key score``).

Neither sends a data source, so items are scored by ``reward.default_scorer`` unless the body
names one (``data_sources``: a list, for OpenRLHF; ``data_source`` for slime). Labels are any
JSON value, delivered to the scorer as the ground truth. No ids: items are numbered.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.reward.types import ScoreRequest, ScoreResult

OPENRLHF_KEYS = {"query", "prompts", "labels", "data_sources"}
SLIME_KEYS = {"prompt", "response", "label", "data_source"}


def openrlhf_requests(body: dict[str, Any], default_scorer: str) -> list[ScoreRequest]:
    _only(body, OPENRLHF_KEYS, "/get_reward")
    queries = _list(body, "query")
    prompts = _list(body, "prompts", [""] * len(queries))
    labels = _list(body, "labels", [""] * len(queries))
    sources = _list(body, "data_sources", [""] * len(queries))
    if not len(queries) == len(prompts) == len(labels) == len(sources):
        raise InvalidArgument("query, prompts, labels (and data_sources) must be equally long")
    rows = zip(queries, prompts, labels, sources, strict=True)
    return [
        _request(str(i), _response_of(q, p), p, label, source, default_scorer)
        for i, (q, p, label, source) in enumerate(rows)
    ]


def openrlhf_reply(results: list[ScoreResult]) -> dict[str, Any]:
    rewards = [r.score for r in results]  # a failed item carries the default score
    names = sorted({name for r in results for name in r.metrics})
    logs = {name: [r.metrics.get(name, 0.0) for r in results] for name in names}
    logs["reward_error"] = [float(bool(r.error)) for r in results]
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


def slime_request(body: dict[str, Any], default_scorer: str) -> ScoreRequest:
    _only(body, SLIME_KEYS, "/slime/reward")
    if not isinstance(body.get("response"), str):
        raise InvalidArgument("/slime/reward needs a string 'response'")
    prompt = body.get("prompt") or ""
    label, source = body.get("label", ""), body.get("data_source") or ""
    return _request("0", body["response"], prompt, label, source, default_scorer)


def slime_reply(result: ScoreResult, detail: bool) -> float | dict[str, Any]:
    return {"score": result.score, "metrics": result.metrics} if detail else result.score


def _request(
    item_id: str, response: str, prompt: Any, label: Any, source: str, default_scorer: str
) -> ScoreRequest:
    if not isinstance(prompt, str) or not isinstance(source, str):
        raise InvalidArgument(f"item {item_id}: prompt and data_source must be strings")
    scorer = None if source else default_scorer
    return ScoreRequest(item_id, source, response, label, {}, scorer, prompt)


def _response_of(query: Any, prompt: str) -> str:
    if not isinstance(query, str):
        raise InvalidArgument("every query must be a string")
    return query[len(prompt) :] if prompt and query.startswith(prompt) else query


def _list(body: dict[str, Any], key: str, default: list | None = None) -> list:
    value = body.get(key, default)
    if not isinstance(value, list):
        raise InvalidArgument(f"{key!r} must be a list")
    return value


def _only(body: dict[str, Any], allowed: set[str], route: str) -> None:
    unknown = set(body) - allowed
    if unknown:
        raise InvalidArgument(
            f"{route}: unknown fields {sorted(unknown)}; known: {sorted(allowed)}"
        )
