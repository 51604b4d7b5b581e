"""``rlfleet up --ray``: the fleet's roles as Ray actors on a Ray cluster (a local one when no
address is given), placed by per-role resources and resource pools (placement groups),
restarted by Ray on failure, and scaled while running (``rlfleet scale rollout=N``).

Modules: ``actors`` (the role actor that runs and supervises one role process; the named
control actor), ``plan`` (what to start, resource requests), ``cluster`` (join or start a
cluster, reserve pools), ``up`` (the launcher), ``scale`` (``rlfleet scale``). Ray is imported
only after argument parsing, inside functions.
"""
