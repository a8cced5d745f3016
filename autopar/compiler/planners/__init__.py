"""One module per method (``data``, ``shard``, ``zero``, ``pipeshard`` with its stage costs in
``stage_costs``, ``auto``: the full search over them) and ``dispatch``, the compiler's one
entry point and the only place that dispatches on the method's type; ``step_program``: what
it plans and gives back.

May import: every other room of ``autopar.compiler``, ``autopar.ir``, ``autopar.methods``,
``autopar.plan``, ``autopar.cluster``, ``autopar.errors``.
"""
