"""One process of a check of ``autopar.runtime.distributed.put`` / ``to_host`` between
processes, run by
``autopar launch --processes 2 --cpu-devices 4`` (tests/test_distributed.py): every kind of
move the pipeline driver makes, each checked against the value it started from, and a transfer
whose receiver waits for it before joining a collective that the sender has already started
(this deadlocked while the CPU client had no thread to spare beyond one per local device; see
``autopar.runtime.process_start._size_cpu_thread_pool``). Writes ``OUT/put-{process id}.json``:
the names of
the checks and whether each came back equal.

    autopar launch --processes 2 --cpu-devices 4 -- python put_check.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar

# before any JAX computation: joins the run the launcher's environment describes
# generous: on a loaded 2-core CI machine one process can lag the other by tens of seconds;
# a dead peer still ends the run quickly (the launcher stops the others)
autopar.runtime.distributed.initialize(initialization_timeout=60, heartbeat_timeout=60,
                               shutdown_timeout=120)


def main(out_dir: str) -> None:
    put, to_host = autopar.runtime.distributed.put, autopar.runtime.distributed.to_host
    devices = autopar.runtime.distributed.global_devices()
    first, second = devices[:4], devices[4:]  # process 0's, process 1's

    def on(devs, shape, names, *spec):
        return NamedSharding(Mesh(np.array(devs).reshape(shape), names), P(*spec))

    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    a = put(value, on(first, (2, 2), ("x", "y"), "x"))  # host value -> process 0's devices
    moves = {
        "host to one process": a,
        "host to both processes": put(value, on(devices, (2, 4), ("h", "d"), "d", "h")),
        "same layout, other process": put(a, on(second, (2, 2), ("x", "y"), "x")),
        "other layout, other process": put(a, on(second, (4,), ("z",), None, "z")),
        "part of the other process": put(a, on(second[:2], (2,), ("z",), "z")),
        "one process to both": put(a, on(devices, (4, 2), ("p", "q"), "p", "q")),
        "both to one process": put(put(value, on(devices, (8,), ("a",), "a")),
                                   on(second, (2, 2), ("x", "y"), "y", "x")),
        "inside one process": put(a, on(first[2:], (2,), ("z",), None, "z")),
        "same devices, new layout": put(a, on(first, (2, 2), ("x", "y"), None, "y")),
        "after a computation": put(jax.jit(lambda v: v * 2 - 1)(a),
                                   on(second, (2, 2), ("x", "y"), "y")),
    }
    expect = {"after a computation": value * 2 - 1}
    result = {name: bool(np.array_equal(to_host(x), expect.get(name, value)))
              for name, x in moves.items()}
    result["scalar to_host"] = float(to_host(put(np.float32(3.5), on(second, (4,), ("z",))))
                                     ) == 3.5
    result["a transfer while a collective waits"] = transfer_while_a_collective_waits(devices)
    with open(os.path.join(out_dir, f"put-{jax.process_index()}.json"), "w") as fh:
        json.dump(result, fh)


def transfer_while_a_collective_waits(devices) -> bool:
    """Process 0 sends a value to process 1 and then starts a collective over all 8 devices;
    process 1 starts late, waits for the value, and only then joins the collective. Meanwhile
    process 0's collective holds one CPU client thread per local device, so its send needs a
    thread beyond those (the pipeline driver makes this pattern when a process reads a value
    from another before its next step)."""
    put, me = autopar.runtime.distributed.put, jax.process_index()

    def on(devs, *spec):
        return NamedSharding(Mesh(np.array(devs), ("a",)), P(*spec))

    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    spread = put(value, on(devices, "a"))
    collective = jax.jit(lambda v: v + 1, out_shardings=on(devices))  # an all-gather
    np.asarray(collective(spread).addressable_data(0))  # compiled, its gloo group set up
    held = put(np.float32(7), on(devices[1:2]))  # on process 0's second device
    held.block_until_ready()
    if me == 1:
        time.sleep(2)  # process 0 is inside the collective below by now
    sent = put(held, on(devices[4:5]))  # to process 1's first device
    got = float(np.asarray(sent.addressable_data(0))) if me == 1 else 7.0
    gathered = np.asarray(collective(spread).addressable_data(0))
    return got == 7.0 and bool(np.array_equal(gathered, value + 1))


if __name__ == "__main__":
    main(sys.argv[1])
