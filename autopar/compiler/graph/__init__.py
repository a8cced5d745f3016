"""From the flat program to the compiler's graph: ``trace`` (step -> FlatProgram ->
``OpGraph``), ``opgraph`` (nodes, tensors, edges), ``op_costs`` (flops per primitive) and
``batch_split`` (how a batch split propagates through the graph and what it must reduce).

May import: ``autopar.ir``, ``autopar.plan``, ``autopar.errors`` and this room.
"""
