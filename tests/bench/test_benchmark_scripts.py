"""The scripts in benchmarks/ still import what they use: nothing else runs them, and two had
kept an import from before ``load_cluster`` moved to ``autopar.cluster``."""

import importlib.util

import pytest
import repo_paths

SCRIPTS = sorted((repo_paths.REPO / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_loads(script):
    # loaded as a module, not as __main__: its imports and definitions run, the benchmark not
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)) or callable(getattr(module, "measure", None))
