"""The router: placement of generation on the fleet. Its core (``core``) over the single
request path (``request_path``, placed and queued by one Lua step: ``enqueue``) and the batch
path (``batch_path``, ``batch``), the pure choice of replica (``routing``, ``admission``), the
janitor that rescues work left on dead replicas (``janitor``), its gRPC glue (``server``), its
HTTP apps (``http``: ``/metrics``, ``/healthz``, and the OpenAI front of
``rlfleet.rollout.gateway``, which this process hosts) and its entry point (``main``,
``rlfleet router``)."""
