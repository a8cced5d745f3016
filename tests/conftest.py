"""Test set-up: 8 simulated CPU devices, fixed before JAX is first imported, and a compilation
cache shared by the processes of one test session (many tests compile the same programs)."""

import gc
import os
import shutil
import tempfile

# LLVM's optimisation of the CPU code is most of XLA's compile time and none of what the tests
# check (numbers, plans, emitted collectives): it is turned down, which makes the suite about a
# third faster. XLA:CPU's newer fusion emitters (MLIR) compile a fused kernel about twice as
# slowly as the loop emitters they replace, for the same HLO: they are turned off too, which
# halves what compiling the zoo's tiny steps takes (16.4 -> 8.3 s for nine programs,
# 2026-11-27). XLA:CPU also splits each program's code into parts it generates on a thread
# pool, and runs each device's matmuls on Eigen's threads: on 2 cores already busy with two
# test workers, both only add threads that wait for a core. Generating the code in one part
# and the matmuls on the device's own thread took a pipeline-heavy third of the suite from 67
# to 51 s and the whole suite from 549-599 to 458-483 s (2026-12-07, the same programs and
# results). The serial reference and the parallel steps are compiled and run alike.
# (Each flag is added once: the xdist workers and the tests' subprocesses inherit the variable,
# and JAX's cache key hashes every flag in it.)
_XLA_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
              "--xla_llvm_disable_expensive_passes=true", "--xla_cpu_use_fusion_emitters=false",
              "--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_multi_thread_eigen=false")
_given = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_given + [f for f in _XLA_FLAGS if f not in _given])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache, fresh for every test session: the session's first process
# (pytest itself, or the pytest-xdist controller) makes a private temporary directory (mode 0700:
# JAX trusts what its cache directory holds) and removes it when the session ends; the xdist
# workers, and the subprocesses tests start, inherit it through the environment, so the two
# workers share what either compiled. Nothing is left in the checkout or kept between sessions,
# so a session times the same on a fresh machine as on a used one (to keep a cache between
# local sessions, set AUTOPAR_TEST_JAX_CACHE_DIR to a directory only you can write: it is used
# and left in place). Every compilation is cached, however quick: the same small programs (a
# stage's slices, a pipeline's tasks) recur across tests, and reading one back takes about a
# twentieth of compiling it.
_SESSION_CACHE_VAR = "AUTOPAR_TEST_JAX_CACHE_DIR"
_OWN_JAX_CACHE_DIR = None
if not os.environ.get(_SESSION_CACHE_VAR):
    _OWN_JAX_CACHE_DIR = tempfile.mkdtemp(prefix="autopar-tests-jax-cache-")
    os.environ[_SESSION_CACHE_VAR] = _OWN_JAX_CACHE_DIR
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_SESSION_CACHE_VAR]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")  # no size floor


import pytest  # noqa: E402


def pytest_collection_finish(session):
    """Python's cyclic garbage collector, tuned for a process that holds large, long-lived
    object graphs (JAX, the test modules, the caches they fill): a full collection comes after
    100 collections of the middle generation rather than 10. Nothing is frozen here: planning
    freezes what the process holds while it plans (``planners.common.fewer_full_collections``)
    only where nothing is frozen yet, and finding out walks every frozen object. A frozen
    collection made every plan walk the whole test process twice, and left the collections
    inside planning scanning what the tests had made since: on four of the heaviest files
    (shard numerics, memory, pipeline numerics, auto search) the collector took 4.2 s of each
    worker's time with it and 1.6 s without (2026-12-06). Reference counting still frees
    everything that is not in a cycle, and no test depends on when a cycle is collected."""
    gc.collect()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)


def pytest_unconfigure(config):
    if _OWN_JAX_CACHE_DIR is not None:
        shutil.rmtree(_OWN_JAX_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _plan_cache_in_a_temporary_directory(tmp_path_factory):
    """parallelize() caches plans on disk by default: keep the tests' plans out of the user's
    cache directory, and start every test session with an empty cache."""
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("autopar-plans"))
    yield
