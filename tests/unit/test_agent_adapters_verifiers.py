"""verifiers (``verifiers==0.3.1``, the classic ``vf`` API) environments through ``agent.env``:
recognised (a ``load_environment`` or an ``Environment`` subclass, ahead of TRL's rule), built
once per worker, a task row made a rollout input, the fleet's sampling made ``sampling_args``,
and a rollout's rubric output made the reward. Rollouts themselves run against a real router in
tests/integration/test_agent_gateway.py (a verifiers rollout needs an OpenAI server).
"""

from __future__ import annotations

import pytest

vf = pytest.importorskip("verifiers")

from datasets import Dataset  # noqa: E402

from rlfleet.agent.adapters import (  # noqa: E402
    ENV_ADAPTERS,
    FUNCTION_ADAPTERS,
    env_factory,
    is_gateway_env,
    load_env_factory,
)
from rlfleet.agent.adapters.verifiers_env import (  # noqa: E402
    VerifiersEnv,
    is_load_environment,
    is_verifiers_env,
    outcome_of,
    rollout_input,
    sampling_args,
)
from rlfleet.agent.adapters.workflow import WorkflowError  # noqa: E402
from rlfleet.rollout.types import SamplingParams  # noqa: E402

ROWS = [{"question": "1+1=", "answer": "2"}]


class Echo(vf.MultiTurnEnv):
    """A MultiTurnEnv subclass the way the hub writes them."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def load_environment(system_prompt: str | None = None) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS), system_prompt=system_prompt)


def test_verifiers_environments_are_recognised_before_trl() -> None:
    assert is_verifiers_env(Echo) and is_verifiers_env(vf.ToolEnv)
    assert not is_verifiers_env(dict) and not is_verifiers_env(VerifiersEnv)
    names = [recognises.__module__.rsplit(".", 1)[-1] for recognises, _, _ in ENV_ADAPTERS]
    assert names.index("verifiers_env") < names.index("trl_env")
    assert is_load_environment(load_environment) and not is_load_environment(Echo)
    assert any(recognises is is_load_environment for recognises, _ in FUNCTION_ADAPTERS)


def test_load_environment_is_called_once_and_shared_by_the_episodes() -> None:
    maker = load_env_factory("examples.agents.verifiers_calc:load_environment", {"kind": "tool"})
    first, second = maker(), maker()
    assert first is second and isinstance(first, VerifiersEnv) and is_gateway_env(first)
    assert isinstance(first.env, vf.ToolEnv) and first.env.max_turns == 4
    from_class = env_factory(Echo, {"dataset": Dataset.from_list(ROWS), "max_turns": 2})()
    assert isinstance(from_class.env, Echo) and from_class.env.max_turns == 2


def test_a_load_environment_returning_something_else_fails_the_start() -> None:
    def load_environment() -> dict:
        return {}

    with pytest.raises(ValueError, match="not a verifiers Environment"):
        env_factory(load_environment, {})


def test_task_rows_become_rollout_inputs() -> None:
    env = load_environment(system_prompt="Add.")
    verl = {
        "prompt": [{"role": "user", "content": "1+1="}],
        "extra_info": {"n": 1},
        "reward_model": {"ground_truth": 2},
    }
    assert rollout_input(env, verl) == {
        "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}],
        "example_id": 0,
        "answer": "2",
        "info": {"n": 1},
    }
    question = rollout_input(env, {"question": "2+2=", "answer": "4", "example_id": 7})
    assert question["prompt"][-1] == {"role": "user", "content": "2+2="}
    assert question["example_id"] == 7 and question["answer"] == "4"
    plain = rollout_input(load_environment(), {"prompt": "3+3="})
    assert plain["prompt"] == [{"role": "user", "content": "3+3="}] and plain["answer"] == ""
    with pytest.raises(WorkflowError, match="no prompt"):
        rollout_input(env, {"answer": "1"})


def test_sampling_args_use_openai_names_and_ask_for_token_ids() -> None:
    args = sampling_args(SamplingParams(temperature=0.7, top_p=0.9, max_tokens=33, seed=5))
    assert args == {
        "max_tokens": 33,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
        "extra_body": {"return_token_ids": True},
    }


def test_the_rubric_output_is_the_reward_and_an_error_fails_the_episode() -> None:
    output = {"reward": 0.5, "metrics": {"exact": 1.0, "num_turns": 2, "bad": float("nan")}}
    assert outcome_of(output) == {"reward": 0.5, "reward_parts": {"exact": 1.0, "num_turns": 2.0}}
    assert outcome_of({"reward": None, "metrics": None})["reward"] == 0.0
    failed = {"reward": 0.0, "error": {"error": "ModelError", "error_chain_repr": "ModelError()"}}
    with pytest.raises(WorkflowError, match="ModelError"):
        outcome_of(failed)


def test_building_an_environment_keeps_the_workers_signal_handlers() -> None:
    """verifiers installs SIGTERM/SIGINT handlers that exit; the env worker's stay in place."""
    import signal

    def mine(signum, frame) -> None:
        return None

    before = signal.signal(signal.SIGTERM, mine)
    try:
        env_factory(load_environment, {})
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
