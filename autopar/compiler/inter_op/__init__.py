"""The inter-operator pass: layer clustering (``layers``), per-layer ILP costs (``layer_costs``;
the per-step parts they amortise, ``step_parts``), submesh shapes and placement (``submesh``),
the stage DP and its options (``stage_dp``, its cap search ``stage_search``, ``stage_options``,
``stages``), rematerialised stage candidates (``remat``).

May import: ``autopar.compiler.graph``, ``autopar.compiler.cost``,
``autopar.compiler.intra_op``, ``autopar.ir``, ``autopar.plan``, ``autopar.errors`` and this
room.
"""
