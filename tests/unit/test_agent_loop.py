"""Episodes against scripted generators and environments: token bookkeeping, end reasons, failures.

The zero-drift test is the point of the token-native design: over many random episodes, with
sampled ids that do not survive decode/encode, the trained tokens are exactly the sampled ones
and every turn's input extends the previous one.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from agent_fixtures import ScriptedGenerator, agent_tokenizer, encode

from rlfleet.agent.environment import calc_env_factory
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.agent.loop import Router, RouterTurnGenerator, SampledTurn, TurnGenerator, run_episode
from rlfleet.agent.render import ChatRenderer
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult, SamplingParams
from rlfleet.tasks import calc

SAMPLING = SamplingParams(max_tokens=64, temperature=1.0)
PROBLEM = calc.Problem((12, 34, 56))
IDEAL = [
    '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>',
    '<tool_call>{"name":"add","arguments":{"a":46,"b":56}}</tool_call>',
    "102",
]


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(agent_tokenizer())


def calc_task(problem: calc.Problem = PROBLEM) -> dict[str, Any]:
    return calc.to_verl_record(problem, "test", 0)


async def play(
    renderer: ChatRenderer, generate: Any, env: Any = None, task: Any = None, **limits: Any
) -> Episode:
    limits = {"max_turns": 8, "max_episode_tokens": 512, **limits}
    env = env if env is not None else calc_env_factory()()
    return await run_episode(
        env,
        task if task is not None else calc_task(),
        generate,
        renderer,
        sampling=SAMPLING,
        episode_id="ep-0",
        **limits,
    )


def assert_turns_extend(episode: Episode, generate: Any) -> None:
    """Every turn's input is the prompt plus the response so far, never re-tokenized."""
    everything = episode.prompt_ids + episode.response_ids
    for prompt, _, session in generate.calls:
        assert session == episode.episode_id
        assert prompt == everything[: len(prompt)]


async def test_an_ideal_calc_episode(renderer: ChatRenderer) -> None:
    generate = ScriptedGenerator(IDEAL)
    episode = await play(renderer, generate)
    assert (episode.end_reason, episode.reward, episode.reward_parts) == (
        EndReason.DONE,
        1.0,
        {"answer": 1.0},
    )
    assert (episode.num_turns, episode.tool_calls, episode.tool_errors) == (3, 2, 0)
    assert [m["role"] for m in episode.messages] == [
        "user",
        *["assistant", "tool"] * 2,
        "assistant",
    ]
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["46", "102"]
    full = renderer.render_ids(episode.messages)
    assert episode.prompt_ids + episode.response_ids == full[:-1]  # all but the final "\n"
    eos = agent_tokenizer().eos_token_id
    assert episode.sampled_ids() == sum((encode(t) + [eos] for t in IDEAL), [])
    assert episode.oldest_version == 7 and episode.generate_s >= 0 and episode.env_s > 0
    assert_turns_extend(episode, generate)
    assert Episode.decode(episode.encode()) == episode


class RandomEnv:
    """Sync methods; random observations (tool and user messages, text of any characters)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.observations: list[list[dict]] = []

    def reset(self, **task: Any) -> list[dict]:
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        rng = self.rng
        observation = [
            {
                "role": rng.choice(["tool", "user"]),
                "tool_call_id": "c",
                "content": "".join(
                    rng.choice("0123456789+=xyz \n{}") for _ in range(rng.randint(0, 12))
                ),
            }
            for _ in range(rng.randint(0, 2))
        ]
        self.observations.append(observation)
        return observation, rng.choice([0.0, 0.5]), rng.random() < 0.15, {}


class RandomGenerator(TurnGenerator):
    """Samples random ids from the whole vocabulary (merged and special tokens included);
    most turns end with eos, some are cut by ``max_tokens``."""

    def __init__(self, rng: random.Random, eos: int, vocab: int) -> None:
        self.rng, self.eos, self.vocab = rng, eos, vocab
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.turns: list[SampledTurn] = []

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str
    ) -> SampledTurn:
        self.calls.append((list(prompt_ids), sampling, session_id))
        ids = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, 20))]
        ids = [t for t in ids if t != self.eos] + ([self.eos] if self.rng.random() < 0.8 else [])
        cut = ids[: sampling.max_tokens]
        turn = SampledTurn(
            cut,
            [-self.rng.randint(0, 64) / 8 for _ in cut],
            self.rng.randint(0, 3),
            "length" if len(cut) < len(ids) else "stop",
        )
        self.turns.append(turn)
        return turn


def where_sampled(episode: Episode, values: list) -> list:
    return [v for v, m in zip(values, episode.response_mask, strict=True) if m]


async def test_zero_drift_over_many_random_episodes(renderer: ChatRenderer) -> None:
    tokenizer, rng, not_round_trip = agent_tokenizer(), random.Random(17), 0
    for n in range(300):
        env = RandomEnv(rng)
        generate = RandomGenerator(rng, tokenizer.eos_token_id, len(tokenizer))
        limits = {"max_turns": rng.randint(1, 6), "max_episode_tokens": rng.randint(12, 200)}
        episode = await run_episode(
            env,
            {"prompt": "12+34="},
            generate,
            renderer,
            sampling=SamplingParams(max_tokens=16),
            episode_id=f"ep-{n}",
            **limits,
        )
        sampled = [t for turn in generate.turns for t in turn.token_ids]
        assert episode.sampled_ids() == sampled
        logprobs = [lp for turn in generate.turns for lp in turn.logprobs]
        assert where_sampled(episode, episode.response_logprobs) == logprobs
        versions = [v for turn in generate.turns for v in turn.versions()]
        assert where_sampled(episode, episode.response_versions) == versions
        assert_turns_extend(episode, generate)
        over = episode.total_tokens > limits["max_episode_tokens"]
        assert not over or (episode.truncated and not episode.response_ids)  # a long prompt
        assert episode.num_turns == len(generate.turns) <= limits["max_turns"]
        assert episode.end_reason != EndReason.ERROR, episode.error
        Episode.decode(episode.encode())
        not_round_trip += encode(tokenizer.decode(sampled)) != sampled
    assert not_round_trip > 100  # the test means something: re-tokenizing would have drifted


async def test_max_turns_ends_an_episode_that_never_answers(renderer: ChatRenderer) -> None:
    generate = ScriptedGenerator([IDEAL[0]])
    episode = await play(renderer, generate, max_turns=3)
    assert (episode.end_reason, episode.num_turns, episode.tool_calls) == (
        EndReason.MAX_TURNS,
        3,
        3,
    )
    assert episode.response_mask[-1] == 1 and episode.reward == 0.0  # no trailing observation


async def test_the_token_budget_shrinks_the_last_turn(renderer: ChatRenderer) -> None:
    generate = ScriptedGenerator(IDEAL)
    prompt = len(renderer.initial_prompt_ids(calc.prompt_messages(PROBLEM)))
    episode = await play(renderer, generate, max_episode_tokens=prompt + 50)
    assert episode.end_reason == EndReason.TOKEN_BUDGET and episode.truncated
    assert episode.total_tokens == prompt + 50
    first_turn = len(generate.calls[0][0]), generate.calls[-1][1].max_tokens
    assert first_turn[1] < SAMPLING.max_tokens and episode.num_turns == 2


async def test_a_prompt_over_the_budget_samples_nothing(renderer: ChatRenderer) -> None:
    generate = ScriptedGenerator(IDEAL)
    episode = await play(renderer, generate, max_episode_tokens=5)
    assert episode.end_reason == EndReason.TOKEN_BUDGET and generate.calls == []


async def test_a_turn_cut_by_max_tokens_is_closed_with_the_template_eos(
    renderer: ChatRenderer,
) -> None:
    generate = ScriptedGenerator(IDEAL)
    env = calc_env_factory()()
    episode = await run_episode(
        env,
        calc_task(),
        generate,
        renderer,
        max_turns=2,
        max_episode_tokens=512,
        sampling=SamplingParams(max_tokens=6),
        episode_id="ep-cut",
    )
    eos = agent_tokenizer().eos_token_id
    first = encode(IDEAL[0])[:6]
    assert episode.response_ids[:7] == first + [eos] and episode.response_mask[:7] == [1] * 6 + [0]
    assert episode.tool_errors == 2 and "no closing" in episode.messages[2]["content"]
    assert episode.end_reason == EndReason.MAX_TURNS


class BadEnv:
    """An environment that breaks the protocol in the way its name says."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def reset(self, **task: Any) -> Any:
        if self.how == "reset_raises":
            raise RuntimeError("no reset")
        if self.how == "reset_non_message":
            return "12+34="
        return [{"role": "user", "content": "12+34="}]

    def step(self, message: dict) -> Any:
        observation = [{"role": "tool", "content": "1"}]
        match self.how:
            case "step_raises":
                raise RuntimeError("boom")
            case "non_message":
                return ["1"], 0.0, False, {}
            case "bad_role":
                return [{"role": "robot", "content": "1"}], 0.0, False, {}
            case "three_values":
                return observation, 0.0, False
            case "nan_reward":
                return observation, float("nan"), False, {}
            case "huge":
                return [{"role": "tool", "content": "x" * (10 << 20)}], 0.0, False, {}
            case "hangs":
                time.sleep(30)
            case "bad_info":
                return observation, 0.0, False, {"tool_errors": "many"}
            case "nan_part":
                return observation, 0.0, False, {"reward_parts": {"format": float("inf")}}
        return observation, 0.0, False, {}


@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("reset_raises", "reset raised RuntimeError: no reset"),
        ("reset_non_message", "reset must return a list of messages"),
        ("step_raises", "step raised RuntimeError: boom"),
        ("non_message", "message 0 is a str"),
        ("bad_role", "role 'robot'"),
        ("three_values", "(messages, reward, done, info)"),
        ("nan_reward", "finite number"),
        ("huge", "over the limit 65536"),
        ("hangs", "step timed out after 0.3s"),
        ("bad_info", "tool_errors must be a count"),
        ("nan_part", "reward part 'format' is not a finite number"),
    ],
)
async def test_a_broken_environment_is_a_failed_episode(
    renderer: ChatRenderer, how: str, error: str
) -> None:
    started = time.perf_counter()
    episode = await play(renderer, ScriptedGenerator(IDEAL), BadEnv(how), {}, step_timeout_s=0.3)
    assert time.perf_counter() - started < 5
    assert episode.failed and error in episode.error
    assert Episode.decode(episode.encode()).error == episode.error


async def test_a_generation_failure_raises(renderer: ChatRenderer) -> None:
    async def broken(prompt_ids: list[int], sampling: Any, session_id: str) -> SampledTurn:
        raise ConnectionError("router down")

    with pytest.raises(ConnectionError):
        await play(renderer, broken)


class RecordingClient(Router):
    """Stands in for RolloutClient: answers from a script, keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        completion = Completion([5, 6, 2], [-0.5, -0.25, -1.0], "ab", "stop")
        if len(self.requests) == 2:
            completion.weight_versions = [3, 3, 4]  # in-flight update, per-token versions
        prompt = request.prompt_token_ids or []
        return GenerateResult(request.request_id, [completion], 4, "r0", prompt)


async def test_router_turn_generator_sends_token_prompts_per_session() -> None:
    client = RecordingClient()
    generate = RouterTurnGenerator(client, timeout_s=30.0, min_weight_version=2)
    sampling = SamplingParams(n=4, max_tokens=8, logprobs=0)
    turns = await asyncio.gather(
        generate([1, 2, 3], sampling, "ep-9"), generate([1, 2, 3, 5, 6, 2], sampling, "ep-9")
    )
    for request in client.requests:
        request.validate()
        assert (request.session_id, request.sampling.n, request.sampling.logprobs) == ("ep-9", 1, 1)
        assert request.min_weight_version == 2 and request.request_id.startswith("ep-9-")
    assert client.requests[1].prompt_token_ids == [1, 2, 3, 5, 6, 2]
    assert len({r.request_id for r in client.requests}) == 2
    assert turns[0] == SampledTurn([5, 6, 2], [-0.5, -0.25, -1.0], 4, "stop", [4, 4, 4])
    assert turns[0].versions() == [4, 4, 4] and turns[1].versions() == [3, 3, 4]
