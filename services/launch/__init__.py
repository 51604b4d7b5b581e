"""``rlfleet up`` and ``rlfleet scale``: starting the fleet's roles and keeping them running.

Two backends run the same fleet plan (``plan``: which roles, in what order, with what
overrides; written once, for both) as the same role processes (``process``: each role's
command line, environment and output, with secrets in the environment, never on a command
line; ``session``: the embedded Redis before, the summary after):

- ``local``: every role a local process, supervised here (``rlfleet up``).
- Ray (``rlfleet up --ray``): each role a Ray actor running the role's own process, placed by
  per-role resources and resource pools (placement groups), restarted by Ray on failure and
  scaled while running (``rlfleet scale rollout=N``, ``env=N`` in agent mode). Modules: ``ray_actors`` (the role actor;
  the named control actor), ``ray_plan`` (a planned member as an actor, resource requests), ``ray_up`` (the
  launcher), ``scale`` (``rlfleet scale``); joining or starting the cluster is
  ``rlfleet.common.ray_cluster`` (the trainer's DDP ranks use it too). Ray is imported only
  after argument parsing, inside functions.

``slurm`` (``rlfleet slurm``) writes a Slurm job that runs the Ray backend over its nodes
(``slurm_plan``: which member goes to the head or the workers; ``slurm_script``: the text).

``up`` parses the command line and picks the backend. This is the top layer: nothing below
it (common, model, the roles) imports it (``scripts/check_layers.py``).
"""
