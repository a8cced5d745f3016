"""The differential campaign (issue 33): generated train steps under every method on 2, 4 and 8
simulated devices, each compared with the plain single-device jax.jit step.

    python benchmarks/fuzz.py --programs 100 --out docs/benchmarks/fuzz

writes ``fuzz.md`` (the command, the machine, the table of outcomes by method and device count,
refusals by reason, every failure) and ``fuzz.jsonl`` (one row per case). Failures are shrunk
and written as reproducers (``--reproducers``, default tests/support/fuzz_reproducers), which
``tests/bench/test_fuzz.py`` runs. The same seeds give the same programs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--devices", default="2,4,8", help="device counts, e.g. 2,4,8")
    parser.add_argument("--methods", default=None, help="comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/fuzz"))
    parser.add_argument("--reproducers", type=Path,
                        default=Path("tests/support/fuzz_reproducers"))
    args = parser.parse_args(argv)

    import jax

    from autopar.bench.fuzz_campaign import METHODS, campaign, summary_table
    from autopar.bench.fuzz_programs import random_spec

    methods = tuple(args.methods.split(",")) if args.methods else METHODS
    devices = tuple(int(d) for d in args.devices.split(","))
    seeds = range(args.first_seed, args.first_seed + args.programs)
    load_before = os.getloadavg()
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import json
    from dataclasses import asdict
    stream = open(args.out.with_suffix(".jsonl"), "w")  # each case as it ends: a stopped
    # campaign keeps what it ran

    def show(result) -> None:
        stream.write(json.dumps(asdict(result)) + "\n")
        stream.flush()
        if result.status in ("mismatch", "traceback"):
            print(f"seed {result.seed} {result.method} {result.devices}: {result.status}: "
                  f"{result.detail}", flush=True)

    results = campaign((random_spec(s) for s in seeds), methods, devices,
                       reproducers=args.reproducers, on_result=show)
    seconds = time.perf_counter() - start
    stream.close()
    command = "python benchmarks/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        "# The differential campaign: generated programs against serial JAX", "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"in {seconds:.0f} s: {args.programs} programs (seeds {seeds.start}-{seeds.stop - 1}) "
        f"x {len(methods)} methods x devices {', '.join(map(str, devices))}, "
        f"{len(results)} cases.", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; Python "
        f"{platform.python_version()}, jax {jax.__version__}; simulated CPU devices "
        f"(`XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}`). Load "
        f"average {load_before[0]:.1f} before and {os.getloadavg()[0]:.1f} after.", "",
        "Each case runs 2 steps of the program under the method on the first N devices and "
        "compares the losses and every leaf of the final state with 2 steps of `jax.jit` on one "
        "device (float32: loss within 2e-4, state within 1e-3 relative; bfloat16 programs "
        "3e-2 and 5e-2). *refused*: a typed autopar error of one line; *traceback*: anything "
        "else. The grammar and the outcomes are described in `autopar/bench/fuzz_programs.py` "
        "and `autopar/bench/fuzz_campaign.py`; failures are shrunk into "
        "`tests/support/fuzz_reproducers/`, which the test suite runs.", "",
    ]
    args.out.with_suffix(".md").write_text("\n".join(header) + summary_table(results) + "\n")
    print(summary_table(results))
    failures = sum(r.status in ("mismatch", "traceback") for r in results)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
