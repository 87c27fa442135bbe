"""kiln's four packages sit at the top of the repository and install as `kiln.compiler`,
`kiln.quant`, `kiln.gates` and `kiln.runtime` (setuptools' package-dir mapping; `kiln` itself
is a namespace). Metadata lives in pyproject.toml; only the package list is computed here,
so a new sub-package needs no edit."""

from setuptools import find_packages, setup

TOP = ("compiler", "quant", "gates", "runtime")

setup(
    package_dir={f"kiln.{top}": top for top in TOP},
    packages=[
        name
        for top in TOP
        for name in (f"kiln.{top}", *(f"kiln.{top}.{sub}" for sub in find_packages(top)))
    ],
)
