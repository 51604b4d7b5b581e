"""A fleet serving the Tinker API (``rlfleet up --config configs/tinker.yaml``) for the tests
that drive it with the official ``tinker`` SDK, and what those tests do to it.

Shared by ``test_tinker_fleet`` (the API, the examples) and ``test_tinker_recovery`` (a replica
killed during a sample, the service restarted from ``save_state``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import safetensors.numpy
import tinker
from procs import ROOT, ServiceProcess, clean_env
from tinker import types

KEY = "tml-fleet-test-key"


def tinker_url(run_dir: Path) -> str | None:
    """The API's base URL once it answers (``endpoints.json``'s ``tinker`` entry)."""
    try:
        url = json.loads((run_dir / "endpoints.json").read_text())["tinker"]["http"]
        with urllib.request.urlopen(url + "/api/v1/healthz", timeout=2) as reply:
            return url if reply.status == 200 else None
    except (OSError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def tinker_fleet(
    run_dir: Path, log: Path, cluster: str, replicas: int = 1, *extra: str
) -> Iterator[tuple[str, ServiceProcess]]:
    """``rlfleet up`` serving the API on the tiny policy (HF replicas, API key ``KEY``):
    yields its base URL and the ``rlfleet up`` process; stopped with SIGTERM after."""
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        "--config",
        str(ROOT / "configs" / "tinker.yaml"),
        "--rollout-replicas",
        str(replicas),
        f"run_dir={run_dir}",
        f"cluster={cluster}",
        "rollout.backend=hf",
        "dashboard.enabled=false",
        "trainer.replica_wait_s=240",
        f"api_key={KEY}",
        "tinker.max_adapters=16",
        *extra,
    ]
    up = ServiceProcess.start(argv, log, name="rlfleet up", env=clean_env())
    try:
        yield up.wait_until(lambda: tinker_url(run_dir), 420, "serving the Tinker API"), up
    finally:
        up.stop(signal.SIGTERM)


def base_model(url: str) -> str:
    caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
    return caps.supported_models[0].model_name


def adapter(run_dir: Path, model_id: str, name: str) -> dict[str, np.ndarray]:
    """The adapter tensors ``save_state(name)`` wrote for training client ``model_id``."""
    folder = run_dir / "tinker" / model_id.replace(":", "_") / "weights" / name
    return safetensors.numpy.load_file(str(folder / "adapter.safetensors"))


def sft_batch(tokenizer, n: int = 16) -> list[types.Datum]:
    """``n`` sums ``a+a=2a``, the loss on the answer's tokens."""
    data = []
    for a in range(n):
        tokens = tokenizer.encode(f"{a}+{a}=") + tokenizer.encode(
            str(2 * a), add_special_tokens=False
        )
        weights = [0.0] * (len(tokens) - 3) + [1.0] * 2
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def train(client, tokenizer, steps: int) -> None:
    """``steps`` cross-entropy ``forward_backward`` + ``optim_step`` pairs on ``sft_batch``."""
    for _ in range(steps):
        fb = client.forward_backward(sft_batch(tokenizer), "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=1e-2))
        fb.result(), step.result()


def assert_trainer_agrees(client, prompt: list[int], sequence) -> None:
    """The replica's log-probs of its sample equal the trainer's under the same adapter."""
    tokens = prompt + list(sequence.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    out = client.forward([datum], "cross_entropy").result()
    mine = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
    np.testing.assert_allclose(mine, sequence.logprobs, atol=2e-3)


def run_example(name: str, url: str, *args: str) -> list[dict]:
    """``examples/tinker/<name>`` against ``url``: the JSON lines it printed."""
    env = {**clean_env(), "TINKER_API_KEY": KEY}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tinker" / name), f"base_url={url}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
