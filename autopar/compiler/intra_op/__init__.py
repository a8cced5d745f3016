"""The intra-operator pass: every tensor's sharding on one logical mesh from an ILP.
``strategies/`` (per primitive family), ``variables`` / ``tying`` / ``edges`` /
``memory_rows`` (the problem's parts), ``problem`` (the ILP as plain data), ``presolve`` and
``mip`` (solving it), ``ilp`` (``solve``), ``sharding_ilp`` (graph in, specs out).

May import: ``autopar.compiler.graph``, ``autopar.compiler.cost``, ``autopar.ir``,
``autopar.methods``, ``autopar.plan``, ``autopar.errors`` and this room.
"""
