"""Libraries that transformers imports only because they are installed, which the report's
float half never uses.

transformers imports scikit-learn (and with it scipy.stats) whenever it is installed, for
assisted generation's confidence threshold and GLUE metrics (lm-eval installs it): 1.3 s of the
float half's 3.9 s of imports (quant/reference.py), spent while the compile's own imports and
the source hash hold the cores. `unused_imports_skipped` marks such a library absent while
transformers is imported (a None in sys.modules: importing it raises ImportError and
importlib.util.find_spec answers None, so transformers' availability check reads it as not
installed) and removes the mark after, so a later import of it loads it as usual. Not used by
`kiln compile` itself: it imports transformers from several threads at different times, and
may run a gate whose lm-eval tasks need scikit-learn.

Hand-written: transformers has no switch for its optional imports.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

UNUSED = ("sklearn",)


@contextmanager
def unused_imports_skipped() -> Iterator[None]:
    """Within: UNUSED libraries not yet imported read as absent; after: as they are."""
    marked = [name for name in UNUSED if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in marked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
