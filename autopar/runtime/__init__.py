"""The only code that owns devices: runs a ``Plan`` under ``jax.jit`` (``executables``: the one
entry from a plan to what runs it; ``shard``: one sharded program; ``pipeline``: the schedule's
driver, ``pipeline_tasks``: each piece's jitted stage programs), times the full search's best
candidates where it plans for these devices (``measured_choice``), multi-process start-up
and moves (``distributed``), counting the collectives XLA emitted (``hlo``; a pipelined step's
programs: ``pipeline_hlo``) and timing collectives and matmuls for calibration
(``calibrate``).

May import: ``autopar.plan``, ``autopar.ir``, ``autopar.cluster``, ``autopar.errors`` and this
room; nothing from the compiler, the frontend or the report.
"""
