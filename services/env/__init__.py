"""The env role (``rlfleet env``): where agent episodes run, apart from the trainer.

Why a role of its own: environment work (tool calls, sandboxes, an env server) must not sit on
the trainer's loop or its cores, and it scales on its own. The trainer sends one step's episode
jobs to ``Env.RunEpisodes`` (``client.EnvClient``); the front door (``service``) puts each on
a Redis stream; workers (``worker``, ``runner``) play them with ``rlfleet.agent`` through the
router, one session per episode, and answer with the encoded episode. ``types`` holds the
plain objects, ``convert`` the proto glue, ``app`` / ``main`` the process.
"""
