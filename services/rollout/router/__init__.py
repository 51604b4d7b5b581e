"""The router: the fleet's generation front door (``core``), whole-step batches routed with a
few round trips (``batch``), the janitor that rescues work left on dead replicas
(``janitor``), the pure choice of replica (``routing``), its gRPC glue (``server``) and its
entry point (``main``, ``rlfleet router``)."""
