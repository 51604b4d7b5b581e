"""The dashboard role (``rlfleet dashboard``, started by ``rlfleet up``): one live web page of a
run: training curves, step time by phase, the fleet (replicas, roles, queues), recent samples,
the config and the time left.

Modules: ``runfiles`` reads what the trainer writes in the run directory (``metrics.jsonl``,
the samples files); ``probe`` asks the fleet (router, registry, health checks, Redis streams,
replicas' ``/metrics``); ``state`` turns both into the one JSON document the page draws;
``app`` serves the page and that document (FastAPI, behind the API key); ``main`` is the entry
point. The page itself is ``page.html``: plain HTML, JS and SVG, nothing fetched from outside.
It sits above the roles (like ``rlfleet status``, which prints its fleet table), so it may read
the rollout registry when no router answers.
"""
