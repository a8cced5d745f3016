"""Where things are in the checkout, for tests that run scripts or read files by path."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
DISTRIBUTED_SCRIPTS = SUPPORT / "distributed_scripts"
FAULT_SCRIPTS = SUPPORT / "fault_scripts"
