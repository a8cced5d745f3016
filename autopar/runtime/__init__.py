"""The only code that owns devices: runs a ``Plan`` under ``jax.jit`` (``shard``: one sharded
program; ``pipeline``: the schedule's driver, ``pipeline_tasks``: each piece's jitted stage
programs), multi-process start-up and moves (``distributed``), counting the collectives XLA
emitted (``hlo``; a pipelined step's programs: ``pipeline_hlo``) and timing collectives and
matmuls for calibration (``calibrate``).

May import: ``autopar.plan``, ``autopar.ir``, ``autopar.cluster``, ``autopar.errors`` and this
room; nothing from the compiler, the frontend or the report.
"""
