"""Plan the tanh-MLP train step with the on-disk plan cache in ``$AUTOPAR_CACHE_DIR``, or stop
inside that until a signal ends the process (tests of interrupted runs).

    python plan_into_cache.py plan
        plan (or take the plan from the cache), run the step, and print one JSON line:
        {"from_cache": ..., "cached_again": ..., "loss": ..., "warnings": [...]}
    python plan_into_cache.py hold-in-planning MARKER
        block once the planner has made the plan, before it is stored
    python plan_into_cache.py hold-in-write MARKER
        block once the cache entry's temporary file is written, before it replaces the entry

A holding process writes MARKER (its pid) when it blocks, and blocks until a signal ends it.
The hooks live here, in the test's script: the library is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

# as in a terminal, even when the test runner was started with SIGINT ignored (a background
# job): Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process without running Python code
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: tanh_mlp

import jax  # noqa: E402
import optax  # noqa: E402
from tanh_mlp import tanh_mlp_step  # noqa: E402

import autopar  # noqa: E402
from autopar.compiler.planners import dispatch  # noqa: E402

METHOD = autopar.ShardParallel(mesh_shape=(2,))


def inputs() -> tuple[dict, dict]:
    opt = optax.sgd(0.1)
    k = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k[0], (8, 16)) * 0.3, jax.random.normal(k[1], (16, 4)) * 0.3]
    batch = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}
    return {"params": params, "opt": opt.init(params)}, batch


def hold(marker: str) -> None:
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:  # until the test's signal ends the process
        time.sleep(0.05)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "hold-in-planning":
        plan = dispatch.plan  # the compiler's entry, which the frontend calls by module

        def plan_then_hold(*args, **kwargs):
            plan(*args, **kwargs)
            hold(argv[1])

        dispatch.plan = plan_then_hold
    elif mode == "hold-in-write":
        cache_dir = Path(os.environ["AUTOPAR_CACHE_DIR"])
        replace = os.replace

        def hold_then_replace(src, dst, *args, **kwargs):
            if Path(dst).parent == cache_dir and Path(src).name.endswith(".tmp"):
                hold(argv[1])
            return replace(src, dst, *args, **kwargs)

        os.replace = hold_then_replace
    elif mode != "plan":
        raise SystemExit(f"unknown mode {mode!r}")

    state, batch = inputs()
    step = autopar.parallelize(tanh_mlp_step(optax.sgd(0.1)), method=METHOD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_cache = step.plan_was_cached(state, batch)
        _, loss = step(state, batch)
        again = autopar.parallelize(tanh_mlp_step(optax.sgd(0.1)), method=METHOD)
        cached_again = again.plan_was_cached(state, batch)
    print(json.dumps({"from_cache": from_cache, "cached_again": cached_again,
                      "loss": float(loss), "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    main(sys.argv[1:])
