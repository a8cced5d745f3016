"""One module per method (``data``, ``shard``, ``zero``, ``pipeshard`` with its stage costs in
``stage_costs``) and ``dispatch``, the compiler's one entry point and the only place that
dispatches on the method's type.

May import: every other room of ``autopar.compiler``, ``autopar.ir``, ``autopar.methods``,
``autopar.plan``, ``autopar.cluster``, ``autopar.errors``.
"""
