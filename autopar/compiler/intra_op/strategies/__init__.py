"""Sharding strategies per primitive family (see ``base.py`` for what a strategy is).

Each family module exposes ``RULES``: primitive name -> generator ``(StrategyContext) ->
list[Strategy]``. :func:`strategies_for` looks the node's primitive up; an unknown primitive
gets the replicated strategy, and one warning naming it (per primitive name and process)
unless ``coverage.REPLICATED_BY_DESIGN`` gives the reason it runs replicated.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import cache

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.coverage import REPLICATED_BY_DESIGN

FAMILY_MODULES = (
    "elementwise", "layout", "reduce", "dot", "conv", "indexing", "slicing", "misc", "control",
    "attention",
)

logger = logging.getLogger("autopar.strategies")

Generator = Callable[[StrategyContext], list[Strategy]]


@cache
def registry() -> dict[str, Generator]:
    """Primitive name -> strategy generator, merged from every family module."""
    merged: dict[str, Generator] = {}
    for module_name in FAMILY_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        for name, rule in module.RULES.items():
            if name in merged and merged[name] is not rule:
                raise RuntimeError(f"two strategy families claim primitive {name!r}")
            merged[name] = rule
    return merged


@cache
def _warn_unknown(primitive: str) -> None:
    # cached: one warning per primitive name, not one per node
    logger.warning(
        "autopar has no sharding strategies for primitive %r; it runs replicated", primitive
    )


def strategies_for(ctx: StrategyContext) -> list[Strategy]:
    """The strategies of ``ctx.node`` (replicated only, with a warning, if unknown)."""
    rule = registry().get(ctx.node.primitive)
    if rule is None:
        if ctx.node.primitive not in REPLICATED_BY_DESIGN:
            _warn_unknown(ctx.node.primitive)
        control = importlib.import_module(f"{__name__}.control")
        return [control.replicated_strategy(ctx)]
    return rule(ctx)


def is_known(primitive: str) -> bool:
    return primitive in registry()


__all__ = ["Strategy", "StrategyContext", "is_known", "registry", "strategies_for"]
