"""How every kiln command turns failures into exit codes (one place for all CLIs).

0 ok, 1 verdict failure, 2 usage or recipe error, 3 runtime failure, 130 interrupted.
Expected mistakes (KilnError) print their message without a traceback.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from kiln.runtime.errors import KilnError

F = TypeVar("F", bound=Callable[..., Any])


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def handle_errors(fn: F) -> F:
    """Wrap a command: KilnError → message + its exit code; anything else → exit 3."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KilnError as exc:
            _say(f"error: {exc.message}")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            _say("interrupted; nothing was published")
            sys.exit(130)
        except Exception as exc:  # an unexpected failure is a runtime failure, exit 3
            if kwargs.get("debug"):
                traceback.print_exc()
            _say(
                f"internal error: {type(exc).__name__}: {exc}\nrerun with --debug for the traceback"
            )
            sys.exit(3)

    return wrapper  # type: ignore[return-value]
