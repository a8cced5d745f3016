"""What users touch besides the decorator: the step-planning shell (``planning``: a saved
plan, the on-disk cache, else the compiler), static non-array leaves of the arguments and
outputs (``static_leaves``, as ``eqx.filter_jit``), the plan cache (``plan_cache``), the terminal
progress line (``progress``) and the ``autopar`` command (``cli/``: one module per subcommand).

May import: anything in ``autopar`` (it sits on top of the compiler, the runtime and the
report).
"""
