"""One process of a run where process 1 dies: both join and run one global computation, then
process 1 exits abruptly (code 7) while process 0 keeps running computations that need it.
The launcher (or, without one, JAX's heartbeat) must end the run; process 0 never finishes.

    autopar launch --processes 2 --cpu-devices 4 -- python die_check.py
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar

# before any JAX computation: joins the run the launcher's environment describes
autopar.runtime.distributed.initialize(initialization_timeout=30, heartbeat_timeout=5,
                               shutdown_timeout=5)


def main() -> None:
    devices = autopar.runtime.distributed.global_devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
    x = autopar.runtime.distributed.put(np.ones((len(devices), 4), np.float32), sharding)
    total = jax.jit(lambda v: v.sum())
    print(f"process {jax.process_index()}: sum {float(total(x))}", flush=True)
    if jax.process_index() == 1:
        os._exit(7)  # no shutdown, no goodbye: as a crash
    while True:  # needs process 1's devices: can only block or fail
        x = jax.jit(lambda v: v * 1.0001, out_shardings=sharding)(x)
        float(total(x))


if __name__ == "__main__":
    main()
    sys.exit(0)
