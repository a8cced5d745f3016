"""Where ``autopar compile`` gets the step it plans: a zoo model, or ``FILE.py:FUNCTION``.

Both give a ``StepSource``: the train-step function, its positional arguments (arrays or
``jax.ShapeDtypeStruct`` pytrees), the batch arguments and, when the source chose one, the
method. For a target, ``FUNCTION()`` is called with no arguments and must return
``(step, args)``, where ``step`` is a plain train step or an ``autopar.ParallelizedStep``
(``autopar.parallelize(fn, method=..., batch_argnums=..., static_argnums=...)``: its options
become the defaults). Everything that can go wrong in the user's file is one line naming it.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import InvalidOptionError, TraceError
from autopar.methods import Method
from autopar.plan import Plan

logger = logging.getLogger(__name__)

_MAX_LISTED = 20


@dataclass
class StepSource:
    """A train step and the arguments to plan it for.

    ``method``: the method the source asks for (a ``parallelize(method=...)``, the zoo's full
    search), or None for the CLI's default. ``saved_plan``: a ``parallelize(plan=...)``.
    ``num_params``: the trainable parameter count when known (for the report).
    """

    name: str
    fn: Callable
    args: tuple[Any, ...]
    batch_argnums: tuple[int, ...] = (1,)
    static_argnums: tuple[int, ...] = ()
    method: Method | None = None
    saved_plan: Plan | None = None
    num_params: int | None = None


# ``--model NAME-scan``: the zoo model with its layers under ``jax.lax.scan`` (stacked
# parameters), for the families whose config has ``scan_layers`` (gpt)
SCANNED_SUFFIX = "-scan"


def zoo_source(name: str, size: str, batch_size: int | None, layers: int | None) -> StepSource:
    """A zoo model's Adam train step on abstract inputs, differentiated with
    ``autopar.value_and_grad`` (so it can be pipelined; other methods see the same equations),
    planned with the full search unless ``--method`` says otherwise. ``NAME-scan`` (``gpt-scan``)
    is the model written with its layers under ``jax.lax.scan``."""
    import autopar
    from autopar.methods import AutoParallel
    from autopar.models import MODEL_NAMES, get_model

    overrides: dict[str, Any] = {"num_layers": layers} if layers is not None else {}
    if name.endswith(SCANNED_SUFFIX):
        name = name.removesuffix(SCANNED_SUFFIX)
        scannable = [m for m in MODEL_NAMES if hasattr(get_model(m).config, "scan_layers")]
        if name not in scannable:
            raise InvalidOptionError(
                f"--model {name}{SCANNED_SUFFIX}: no scanned variant of '{name}'; scanned zoo "
                f"models: {', '.join(m + SCANNED_SUFFIX for m in scannable)}")
        overrides["scan_layers"] = True
    model = get_model(name, size, batch_size=batch_size, **overrides)
    marked = model.with_value_and_grad(autopar.value_and_grad)
    return StepSource(
        name=f"{name}{SCANNED_SUFFIX if overrides.get('scan_layers') else ''} {size}",
        fn=marked.train_step, args=tuple(marked.abstract_inputs()),
        batch_argnums=(1,), method=AutoParallel(), num_params=model.num_params(),
    )


def parse_argnums(text: str, flag: str) -> tuple[int, ...]:
    """``"1"`` or ``"1,2"`` -> ``(1,)`` / ``(1, 2)``."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise InvalidOptionError(f"{flag} takes argument positions such as 1 or 1,2; got "
                                 f"'{text}'")
    return tuple(int(p) for p in parts)


def user_source(target: str, batch_argnums: tuple[int, ...] | None = None) -> StepSource:
    """Import ``FILE.py``, call ``FUNCTION()`` and check the ``(step, args)`` it returns.

    ``batch_argnums``: the ``--batch-argnums`` option (default: the ParallelizedStep's, else 1).
    """
    path, func_name = _split_target(target)
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)  # the file's own imports of its neighbours
    try:
        module = _import_file(path)
        make_step = _find_function(module, func_name, path)
        start = time.perf_counter()
        returned = _call(make_step, target, path)
        logger.debug("%s returned in %.2f s", target, time.perf_counter() - start)
    finally:
        try:
            sys.path.remove(directory)
        except ValueError:
            pass
    source = _checked_source(target, returned, batch_argnums)
    logger.info("%s: step %s, %d argument(s), batch argument(s) %s%s", target,
                getattr(source.fn, "__name__", "?"), len(source.args), list(source.batch_argnums),
                f", static argument(s) {list(source.static_argnums)}"
                if source.static_argnums else "")
    return source


def _split_target(target: str) -> tuple[Path, str]:
    file_text, sep, func_name = target.rpartition(":")
    example = "e.g. examples/mlp_step.py:make_step"
    if not sep or not file_text:
        raise InvalidOptionError(f"target '{target}' names no function; write FILE.py:FUNCTION, "
                                 f"{example}")
    if not func_name.isidentifier():
        raise InvalidOptionError(f"target '{target}': '{func_name}' is not a function name; "
                                 f"write FILE.py:FUNCTION, {example}")
    path = Path(file_text)
    if not path.exists():
        raise InvalidOptionError(f"target '{target}': no such file '{path}'")
    if not path.is_file():
        raise InvalidOptionError(f"target '{target}': '{path}' is not a file; write "
                                 f"FILE.py:FUNCTION, {example}")
    return path, func_name


def _import_file(path: Path) -> Any:
    name = f"_autopar_target_{uuid.uuid4().hex}"  # a fresh module per load: no stale imports
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InvalidOptionError(f"cannot import '{path}': not a Python source file (.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    logger.debug("importing %s as module %s", path, name)
    start = time.perf_counter()
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise InvalidOptionError(
            f"cannot import '{path}': {_exception_text(exc)}{_where(exc, path)}"
        ) from exc
    logger.debug("imported %s in %.2f s", path, time.perf_counter() - start)
    return module


def _find_function(module: Any, func_name: str, path: Path) -> Callable:
    if not hasattr(module, func_name):
        defined = sorted(
            n for n, v in vars(module).items()
            if not n.startswith("_") and callable(v)
            and getattr(v, "__module__", None) == module.__name__
        )
        if defined:
            listed = ", ".join(defined[:_MAX_LISTED])
            more = f" and {len(defined) - _MAX_LISTED} more" if len(defined) > _MAX_LISTED else ""
            have = f"functions defined there: {listed}{more}"
        else:
            have = "it defines no functions"
        raise InvalidOptionError(f"'{path}' has no function '{func_name}'; {have}")
    found = getattr(module, func_name)
    if not callable(found):
        raise InvalidOptionError(f"'{func_name}' in '{path}' is a {type(found).__name__}, not a "
                                 "function")
    return found


def _call(make_step: Callable, target: str, path: Path) -> Any:
    try:
        signature = inspect.signature(make_step)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        required = [p.name for p in signature.parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise InvalidOptionError(f"{target} must take no arguments; it needs "
                                     f"{', '.join(required)}")
    try:
        return make_step()
    except (Exception, SystemExit) as exc:
        raise InvalidOptionError(
            f"{target} raised {_exception_text(exc)}{_where(exc, path)}"
        ) from exc


def _checked_source(target: str, returned: Any,
                    batch_argnums: tuple[int, ...] | None) -> StepSource:
    from autopar.api import ParallelizedStep
    from autopar.frontend.planning import bind_static_args

    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        raise InvalidOptionError(f"{target} must return (step, args); it returned "
                                 f"{_describe(returned)}")
    step, args = returned
    method = saved = None
    static: tuple[int, ...] = ()
    default_batch: tuple[int, ...] = (1,)
    if isinstance(step, ParallelizedStep):
        method = None if step.method_defaulted else step.method
        saved, static, default_batch = step.saved_plan, step.static_argnums, step.batch_argnums
        step = step.fn
    if not callable(step):
        raise InvalidOptionError(f"the step {target} returned is {_describe(step)}, not a "
                                 "function; return (train_step, args) or "
                                 "(autopar.parallelize(train_step), args)")
    if not isinstance(args, (tuple, list)):
        raise InvalidOptionError(f"the args {target} returned must be a tuple of the step's "
                                 f"positional arguments; got {_describe(args)} (one argument: "
                                 "write (arg,))")
    args = tuple(args)
    batch = default_batch if batch_argnums is None else batch_argnums
    for i in (*batch, *static):
        if i >= len(args):
            raise InvalidOptionError(
                f"{'static_argnums' if i in static else 'batch argument'} {i} is out of range: "
                f"{target} returned {len(args)} argument(s) for the step"
            )
    _check_batch_leaves(step, args, set(batch) - set(static), target)  # overlap: below
    bind_static_args(step, args, static, batch)  # both static and batch: one line
    return StepSource(
        name=target, fn=step, args=args, batch_argnums=batch,
        static_argnums=static, method=method, saved_plan=saved,
        num_params=_count_params(args, set(batch) | set(static)),
    )


def _check_batch_leaves(step: Callable, args: Sequence[Any], batch: set[int],
                        target: str) -> None:
    """The batch arguments must be arrays (other arguments' non-array leaves are static)."""
    import jax

    from autopar.frontend.static_leaves import is_array_leaf
    from autopar.ir.flatten import argument_names, leaf_path

    names = argument_names(step, len(args))
    for i, (name, arg) in enumerate(zip(names, args, strict=True)):
        if i not in batch:
            continue
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not is_array_leaf(leaf):
                raise TraceError(
                    f"argument leaf '{leaf_path(name, keypath)}' of the args {target} returned "
                    f"is {_describe(leaf)}; a batch must be a pytree of arrays or "
                    "jax.ShapeDtypeStruct (non-array leaves are static only in the other "
                    "arguments)"
                )


def _count_params(args: Sequence[Any], skip: set[int]) -> int | None:
    """Elements under a ``params`` entry (key or attribute) of the state arguments; None when
    no argument has one."""
    import jax

    total, found = 0, False
    for i, arg in enumerate(args):
        if i in skip:
            continue
        params = arg.get("params") if isinstance(arg, Mapping) else getattr(arg, "params", None)
        if params is None:
            continue
        found = True
        total += sum(math.prod(getattr(leaf, "shape", ()))
                     for leaf in jax.tree_util.tree_leaves(params))
    return total if found else None


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    if isinstance(value, str):
        short = value if len(value) <= 40 else value[:37] + "..."
        return f"a str ({short!r})"
    return f"a {type(value).__name__}"


def _exception_text(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _where(exc: BaseException, path: Path) -> str:
    """`` (FILE line N)`` for the innermost frame of the exception inside the user's file."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return ""  # its message already names the file and line
    resolved = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename and str(Path(f.filename).resolve()) == resolved]
    return f" ({path} line {frames[-1].lineno})" if frames else ""
