"""The OpenAI-compatible front and the agent gateway on it, hosted by the router process.

Why a package of its own: the router's job is placement (which replica, queued how, rescued
when it dies: ``rlfleet.rollout.router``); this package's job is speaking HTTP to callers that
are not rlfleet: the OpenAI bodies and their mapping (``openai_api``), the served model and
its tokenizer (``policy``), errors in OpenAI's shape (``http_errors``), the FastAPI app
(``app``: ``create_app`` over anything that generates, ``app.Fleet``), and the agent gateway:
tool calls and token ids in chat (``extensions``), sessions that record a black-box agent's
calls (``sessions`` in Redis, ``session_routes`` for ``/rl/*``) and the trained records they
become (``trajectory``). It never imports the router; the router imports it
(``rollout.router.http``).
"""
