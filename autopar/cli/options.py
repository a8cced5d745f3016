"""Flags every subcommand shares (kept apart from ``main`` so that subcommand modules can use
them without importing the dispatcher that imports them)."""

from __future__ import annotations

import argparse

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")


def add_log_level(parser: argparse.ArgumentParser, default: object) -> None:
    """``--log-level``: messages of this level and above go to stderr."""
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=default,
        help="log messages of this level and above to stderr (default warning)",
    )
