"""How every kiln command turns failures into exit codes (one place for all CLIs).

0 ok, 1 verdict failure, 2 usage or recipe error, 3 runtime failure, 130 interrupted.
Expected mistakes (KilnError) print their message without a traceback; a full disk says so
(exit 3) whichever library's exception carries it; an unexpected failure prints its
traceback too when the command line said `--debug` (`debug_option`).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from kiln.runtime.base.errors import KilnError, disk_full

F = TypeVar("F", bound=Callable[..., Any])
_DEBUG = "kiln.debug"  # key in click's context meta, which nested commands share


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _remember_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_DEBUG] = True


def debug_option(hidden: bool = False) -> click.Option:
    """The `--debug` flag; it takes no function argument, `handle_errors` reads it."""
    return click.Option(
        ["--debug"],
        is_flag=True,
        expose_value=False,
        hidden=hidden,
        callback=_remember_debug,
        help="Print the traceback of an unexpected failure (exit 3).",
    )


def _debugging() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and bool(ctx.meta.get(_DEBUG))


def handle_errors(fn: F) -> F:
    """Wrap a command: KilnError → message + its exit code; a full disk → its message, exit
    3 (whatever wrapped it); anything else → exit 3."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            _say("interrupted; nothing was published")
            sys.exit(130)
        except Exception as exc:
            full = disk_full(exc)
            if full is not None:
                _say(f"error: {full}")
                sys.exit(3)
            if isinstance(exc, KilnError):
                _say(f"error: {exc.message}")
                sys.exit(exc.exit_code)
            # an unexpected failure is a runtime failure, exit 3
            if _debugging():
                traceback.print_exc()
            _say(
                f"internal error: {type(exc).__name__}: {exc}\n"
                "rerun as `kiln --debug ...` for the traceback"
            )
            sys.exit(3)

    return wrapper  # type: ignore[return-value]
