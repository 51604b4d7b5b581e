"""Process-wide counts of outgoing gRPC calls, by method.

Why: "fewer, fatter hops" is a claim about calls per training step; the trainer reports the
per-step difference of these counts as metrics (``perf/grpc_calls``), and benchmarks read
them from ``metrics.jsonl``. The client channels count (see ``grpc_client.make_channel``);
this module holds only the numbers and never imports grpc.
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_calls: Counter[str] = Counter()


def record(method: str) -> None:
    """Count one call of ``method`` (``/package.Service/Method``; the last part is kept)."""
    name = method.rsplit("/", 1)[-1] or method
    with _lock:
        _calls[name] += 1


def snapshot() -> dict[str, int]:
    """Calls so far, by method name."""
    with _lock:
        return dict(_calls)


def per_step_metrics(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """``perf/grpc_calls`` (total) and ``perf/grpc_calls/<Method>`` made between two snapshots."""
    deltas = {name: after[name] - before.get(name, 0) for name in after}
    deltas = {name: count for name, count in deltas.items() if count}
    metrics = {f"perf/grpc_calls/{name}": float(count) for name, count in sorted(deltas.items())}
    metrics["perf/grpc_calls"] = float(sum(deltas.values()))
    return metrics
