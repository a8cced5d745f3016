"""The compiler: pure planning. A traced step (``autopar.ir``), a method (``autopar.methods``)
and a cluster description in; a ``Plan`` (``autopar.plan``) out. Nothing here touches devices
or real arrays, so a plan for 1,024 described GPUs is made on a laptop.

Rooms: ``graph`` (trace to OpGraph, op costs, the batch split), ``cost`` (logical meshes,
collectives, resharding, the memory model, calibration fit), ``intra_op`` (the sharding ILP),
``inter_op`` (layers, layer costs, the stage DP), ``planners`` (one module per method and the
one dispatch over them).

May import: ``autopar.plan``, ``autopar.methods``, ``autopar.errors``, ``autopar.cluster``,
``autopar.ir``; never ``autopar.runtime``, ``autopar.frontend`` or ``autopar.report``
(``tests/test_architecture.py`` checks it).
"""
