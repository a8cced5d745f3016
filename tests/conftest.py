"""Test set-up: 8 simulated CPU devices, fixed before JAX is first imported, and a compilation
cache shared by the test processes of one checkout (many tests compile the same stage programs)."""

import os

# LLVM's optimisation of the CPU code is most of XLA's compile time and none of what the tests
# check (numbers, plans, emitted collectives): it is turned down, which makes the suite about a
# third faster. The serial reference and the parallel steps are compiled alike.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Inside the checkout's (git-ignored) pytest cache: JAX trusts its cache directory, so it must
# not be one that other users can write. Entries are keyed by program, options and devices.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                 "jax-compilation-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _plan_cache_in_a_temporary_directory(tmp_path_factory):
    """parallelize() caches plans on disk by default: keep the tests' plans out of the user's
    cache directory, and start every test session with an empty cache."""
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("autopar-plans"))
    yield
