"""Config sections of the reward role: the service, its user functions, the sandbox they run
in, and the judge and reward-model scorers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfleet.common.config.base import Section


class UserScorerConfig(Section):
    path: str
    """Python file defining the function."""
    name: str = "compute_score"
    """Function name, called by keyword as verl does: ``compute_score(data_source=...,
    solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)`` (``prompt=`` too when
    it names that parameter), sync or ``async def``; or verl's batch form, taking
    ``data_sources, solution_strs, ground_truths, extra_infos`` lists and returning a list."""
    reward_kwargs: dict[str, Any] = {}
    """Extra keyword arguments passed on every call."""
    data_sources: list[str] = []
    """data_source values routed to this scorer (empty = it is the default for unknown ones)."""


class SandboxLimits(Section):
    """Limits of one sandboxed child (a user-function worker, or one run of the ``code``
    scorer). What the kernel enforces and what only a Python audit hook does is in
    docs/reward_service.md ("The sandbox")."""

    timeout_s: float = 10.0
    """Wall clock of one call (one item, or one batch-form call) or one program run; past it
    every process of the call is killed (its pid namespace, or its process group where no
    namespaces are available; a pool worker is then replaced)."""
    cpu_s: float = 10.0
    """CPU seconds per call or run (RLIMIT_CPU; SIGXCPU ends the child)."""
    memory_mb: int = 2048
    """Address space of the child (RLIMIT_AS): allocation past it raises MemoryError."""
    file_size_mb: int = 16
    """Largest file the child may write (RLIMIT_FSIZE)."""
    processes: int = 256
    """Processes one call may have: a pids cgroup per call where the service can create one
    (binds root too), else RLIMIT_NPROC (binds only a non-root user); every process of the
    call is killed when it returns."""
    workers: int = 2
    """Sandboxed user-function processes per reward process, and concurrent ``code`` runs."""
    output_kb: int = 1024
    """Most stdout/stderr kept from one ``code`` run; more kills the run."""


DEFAULT_JUDGE_TEMPLATE = """You are grading an answer to a problem.
Problem: {prompt}
Reference answer: {ground_truth}
Answer to grade: {response}
Rate the answer from 0 (wrong) to 10 (fully correct). Reply with one line: "Score: N"."""


class JudgeConfig(Section):
    """The ``judge`` scorer: an LLM behind an OpenAI-compatible endpoint grades each response
    (docs/reward_service.md, "Model-based rewards")."""

    base_url: str
    """Endpoint up to ``/v1``: the fleet router's HTTP front (``http://host:router.http_port/v1``)
    or any vLLM / OpenAI-compatible server."""
    model: str = ""
    """``model`` sent in each request; empty sends none (the router serves one model; vLLM
    then takes its only served model)."""
    api: Literal["chat", "completions"] = "chat"
    """``chat``: ``/chat/completions`` with the filled template as the user message (the
    server applies the model's chat template); ``completions``: ``/completions`` with the
    filled template as the raw prompt."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """Prompt of one item. Placeholders: ``{prompt}`` (the request's prompt, else
    ``extra_info.question``, else ``extra_info.prompt``), ``{response}``, ``{ground_truth}``,
    ``{data_source}``, ``{extra_info.KEY}``; any other brace is literal text (``\\boxed{}``
    needs no escaping). A placeholder the item cannot fill is that item's error."""
    system: str = ""
    """System message before the template (``api: chat`` only); empty: none."""
    score_regex: str = r"(?i)score\W{0,4}?(-?\d+(?:\.\d+)?)"
    """The score is the first group of this expression's *last* match in the judge's answer
    (the whole match when it has no group); no match, or not a number, is garbage."""
    min_score: float = 0.0
    """Lowest score the template asks for; a parsed score below it is garbage."""
    max_score: float = 10.0
    """Highest score the template asks for; a parsed score above it is garbage."""
    normalize: bool = True
    """Map the parsed score from ``[min_score, max_score]`` onto ``[0, 1]``; false keeps it."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens of one judge answer."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the judge (0: greedy, so a retry of garbage only helps with
    a transport failure; above 0 a retry samples a new answer)."""
    max_concurrency: int = Field(8, ge=1)
    """Judge requests in flight at once from one reward process (all its workers together)."""
    timeout_s: float = Field(30.0, gt=0)
    """Longest one judge request may take (connect to last byte); past it the attempt fails."""
    retries: int = Field(2, ge=0)
    """Further attempts after a failed one (connection refused, timeout, HTTP 429/5xx, an
    answer with no score); a 4xx other than 408/429 is not retried. An item's worst case is
    ``(retries + 1) * timeout_s`` plus the back-offs."""
    backoff_s: float = Field(0.5, ge=0)
    """Wait before retry k: ``backoff_s * 2**(k-1)``."""
    api_key_env: str | None = None
    """Environment variable holding the endpoint's bearer token (never the token itself in a
    config file); None sends no ``Authorization`` header."""
    data_sources: list[str] = []
    """data_source values routed to the judge (besides requests naming ``scorer: judge``)."""


class RewardModelConfig(Section):
    """The ``reward_model`` scorer: a sequence-classification head scores (prompt, response)
    in the reward workers (docs/reward_service.md, "Model-based rewards")."""

    path: str
    """Hugging Face directory of an ``AutoModelForSequenceClassification`` model (or a Hub id
    resolved through the cache, or a short name ``make`` builds); loaded once per reward
    process, on its first item."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the reward model."""
    max_length: int = Field(2048, ge=1)
    """Most tokens of one (prompt, response) sequence; a longer item is refused with this
    limit named in its error (never silently truncated)."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    label: int | None = None
    """With more than one label: the score is the softmax probability of this label (None:
    the last). With one label the score is its logit, as reward models are trained."""
    chat_template: bool = True
    """Format (prompt, response) as a user and an assistant message with the tokenizer's chat
    template when it has one and the item has a prompt; else prompt + response as text."""
    torch_threads: int | None = None
    """Intra-op threads of its forward passes (None: torch's default)."""
    data_sources: list[str] = []
    """data_source values routed to the reward model (besides ``scorer: reward_model``)."""


class RewardConfig(Section):
    host: str = "127.0.0.1"
    """Interface the reward gRPC server binds to."""
    port: int = 50061
    """Reward gRPC port."""
    http_port: int | None = None
    """Port of the HTTP (FastAPI) front door; None = off."""
    workers: int = 1
    """Reward worker tasks started inside the service process (0: none, a front door only).
    Never fewer than the lanes slow items run on (``sandbox_limits.workers`` sandboxed
    children, or 4 threads with ``sandbox: false``), so a job holding a hung item never holds
    the process's only worker."""
    custom: UserScorerConfig | None = None
    """A user scoring function (verl ``compute_score`` signature)."""
    request_timeout_s: float = 60.0
    """How long a scoring request waits for a worker."""
    local_first: bool = True
    """Score a request inside the process that received it when one of its own workers is idle
    (no Redis hop; durable because the caller retries a failed RPC); else queue it."""
    default_scorer: str = "math"
    """Scorer for HTTP callers that name no data_source (OpenRLHF ``/get_reward``, slime)."""
    composite: dict[str, float] = {"math": 0.9, "format": 0.1}
    """The ``composite`` scorer: a weighted sum of these built-in scorers' scores."""
    sandbox: bool = True
    """Run the user function (``custom``) in sandboxed child processes (``sandbox_limits``: a
    timeout, CPU, memory, file size, no network, scrubbed environment, empty cwd); false runs
    it in threads of the service (trusted code only). The ``code`` scorer is always sandboxed."""
    sandbox_limits: SandboxLimits = SandboxLimits()
    """Limits of each sandboxed process."""
    default_score: float = 0.0
    """Score of an item that could not be scored (its ``error`` says why): a raise, a timeout,
    a crash, a sandbox violation, an unknown data source."""
    code_scoring: Literal["fraction", "all"] = "fraction"
    """``code`` scorer: the fraction of tests passed, or 1.0 only when all pass."""
    judge: JudgeConfig | None = None
    """The ``judge`` scorer (an LLM grades each response through an OpenAI-compatible
    endpoint); None: no judge scorer."""
    reward_model: RewardModelConfig | None = None
    """The ``reward_model`` scorer (a sequence-classification model run in the reward
    workers); None: no reward-model scorer."""
