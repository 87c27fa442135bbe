"""YAML as kiln's users write it: PyYAML's safe loader with YAML 1.2's numbers.

PyYAML implements YAML 1.1, whose floats need a dot and a signed exponent (`1.0e+3`), so
`1e-5`, `1e3` and `1.0e3` come back as strings: the classic trap for a threshold or a
learning rate written the way every other tool writes it. `Loader` adds YAML 1.2's exponent
floats to a copy of the safe loader's resolvers; everything else (ints, `1.5`, `.inf`,
booleans) resolves as before, and yaml.SafeLoader itself is unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e3`, `1e-5`, `1.0e3` and `.5E3` as floats."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def safe_load(text: str) -> Any:
    """`yaml.safe_load` with YAML 1.2's exponent floats."""
    return yaml.load(text, Loader=Loader)
