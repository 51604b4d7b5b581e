"""The Tinker API keeps the other roles' promises when a process dies (issue 32, item 3), with
real processes driven by the official ``tinker`` SDK:

- a rollout replica SIGKILLed while a ``sample`` waits on it: the call is answered once, with
  every sample it asked for, drawn from the sampling client's own weights;
- the service restarted (``rlfleet up`` stopped and started again on the same run directory):
  a training client that loads a ``save_state`` checkpoint with its optimizer goes on exactly as
  the saved client went on before the restart; without the optimizer it does not.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import redis
import tinker
from tinker import types
from tinker_proc import (
    KEY,
    adapter,
    assert_trainer_agrees,
    base_model,
    tinker_fleet,
    train,
)
from up_proc import replica_pid

from rlfleet.common.keys import Keys

pytestmark = pytest.mark.slow
REPLICAS = ("rollout-0", "rollout-1")


class Streams:
    """The replicas' request streams in the fleet's Redis."""

    def __init__(self, run_dir: Path, cluster: str) -> None:
        url = json.loads((run_dir / "endpoints.json").read_text())["redis"]["url"]
        self.redis, self.keys = redis.Redis.from_url(url), Keys(cluster)

    def holder(self) -> str | None:
        """The replica that has read a request and not answered it yet, if one has."""
        for replica in REPLICAS:
            stream = self.keys.rollout_stream(replica)
            if self.redis.exists(stream) and any(
                group["pending"] for group in self.redis.xinfo_groups(stream)
            ):
                return replica
        return None

    def added(self) -> dict[str, int]:
        """Entries ever queued on each replica's stream (0 for a stream not made yet)."""
        streams = {replica: self.keys.rollout_stream(replica) for replica in REPLICAS}
        return {
            replica: int(self.redis.xinfo_stream(stream)["entries-added"])
            if self.redis.exists(stream)
            else 0
            for replica, stream in streams.items()
        }


def test_a_replica_killed_during_sample_is_answered_once(tmp_path) -> None:
    run_dir, cluster = tmp_path / "run", "tinkerkill"
    # each request waits 2 s on its replica before generating: time to kill it mid-request
    slow = ("rollout.debug_generate_delay_s=2", "rollout.heartbeat_ttl_s=2")
    with tinker_fleet(run_dir, tmp_path / "up.log", cluster, 2, *slow) as (url, up):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        try:
            client = service.create_lora_training_client(
                base_model=base_model(url), rank=4, train_unembed=False
            ).result()
            tokenizer = client.get_tokenizer()
            train(client, tokenizer, 1)
            sampler = client.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))
            params = types.SamplingParams(max_tokens=4, temperature=1.0)
            sampler.sample(prompt, 1, params).result()  # the snapshot is on both replicas now
            streams = Streams(run_dir, cluster)
            before = streams.added()
            future = sampler.sample(prompt, 4, params)
            victim = up.wait_until(streams.holder, 60, "a replica holding the sample")
            held = streams.added()  # the victim's stream goes when it dies: count it now
            os.kill(replica_pid(run_dir, victim), signal.SIGKILL)
            result = future.result(timeout=120)
            assert len(result.sequences) == 4
            for sequence in result.sequences:
                assert_trainer_agrees(client, prompt.to_ints(), sequence)
            after = streams.added()
        finally:
            service.close("success").result()
        (survivor,) = set(REPLICAS) - {victim}
        # queued once on the victim, moved once to the survivor: one answer, no second run
        assert held[victim] == before[victim] + 1, (before, held)
        assert after[survivor] == before[survivor] + 1, (before, after)
        assert f"replica '{victim}' exited with code -9; restarting it" in up.log()


def test_a_restarted_service_goes_on_from_save_state(tmp_path) -> None:
    run_dir, cluster = tmp_path / "run", "tinkerrestart"
    with tinker_fleet(run_dir, tmp_path / "up1.log", cluster) as (url, _):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        client = service.create_lora_training_client(
            base_model=base_model(url), rank=4, train_unembed=False
        ).result()
        tokenizer = client.get_tokenizer()
        train(client, tokenizer, 2)  # Adam's moments are not zero from here on
        saved = client.save_state("mid").result().path
        train(client, tokenizer, 1)
        client.save_state("next").result()
        first = client.model_id
        service.close("success").result()
    with tinker_fleet(run_dir, tmp_path / "up2.log", cluster) as (url, _):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        clients = {
            with_optimizer: service.create_lora_training_client(
                base_model=base_model(url), rank=4, train_unembed=False
            ).result()
            for with_optimizer in (True, False)
        }
        clients[True].load_state_with_optimizer(saved).result()
        clients[False].load_state(saved).result()
        for restored in clients.values():
            restored.save_state("loaded").result()
            train(restored, tokenizer, 1)
            restored.save_state("went-on").result()
        ids = {with_optimizer: c.model_id for with_optimizer, c in clients.items()}
        service.close("success").result()
    assert first not in ids.values(), "a restarted service reused a training client's id"
    mid, went_on = adapter(run_dir, first, "mid"), adapter(run_dir, first, "next")
    for with_optimizer, model_id in ids.items():
        loaded = adapter(run_dir, model_id, "loaded")
        assert all(np.array_equal(loaded[k], mid[k]) for k in mid)
        step = adapter(run_dir, model_id, "went-on")
        same = all(np.allclose(step[k], went_on[k], atol=1e-6) for k in went_on)
        assert same == with_optimizer, f"optimizer restored: {with_optimizer}"
