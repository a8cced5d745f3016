"""The planning shell between the decorator (``api.py``) and the compiler: a saved plan, the
on-disk cache, else the compiler (``planning``); static non-array leaves of the arguments and
outputs (``static_leaves``, as ``eqx.filter_jit``); the plan cache (``plan_cache``); the
terminal progress line (``progress``).

May import: the compiler, ``methods``, ``plan``, ``ir``, ``cluster``, ``errors`` and
``version``. Never the runtime (the runtime's measured choice comes in as a hook), the API
shell above it, or the command line (``autopar.cli``, the top of the house).
"""
