"""Faults: what ends a run and what keeps a long one going.

- ``diagnosis``: a fault (disk full, a lost or hung peer, out of memory, vanished data,
  an unreadable checkpoint, SIGTERM) in one line, and the exit status of its class;
- ``recovery``: non-finite steps skipped, loss spikes rolled back to the newest checkpoint;
- ``replicas``: torchft replica groups (the ``ft`` extra): steps that survive a lost group.

Imports: torch_compat, spec, config, mesh, parallel, checkpoint, converters.
"""
