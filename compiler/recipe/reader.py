"""Reading one recipe file: YAML with the line of every key, within bounds no file can pass.

A recipe is a few dozen keys, so the bounds below are generous for any real one. They stop
hostile files before they cost anything: PyYAML shares an alias's value instead of copying
it, so a "billion laughs" file loads in a blink and then takes minutes and gigabytes to
walk, validate or print; and PyYAML's composer recurses once per nesting level, so ten
thousand `[` end in a RecursionError. Here the composer itself counts, for every node, how
many values it stands for with its aliases expanded and how deep it reaches, and refuses
the file the moment either passes its bound — before any Python object is built.
PyYAML has no such limits of its own, hence this module.

Numbers are read as YAML 1.2 reads them (runtime/base/yaml12.py): `1e-5` is a float, not
the string PyYAML's YAML 1.1 makes of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.compiler.recipe.errors import RecipeError
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.files import open_regular
from kiln.runtime.base.yaml12 import Loader

Key = tuple[str | int, ...]
Origins = dict[Key, tuple[Path, int]]

MAX_BYTES = 1 << 20  # a recipe is a few kilobytes
MAX_VALUES = 10_000  # values in the whole document, every alias expanded
MAX_DEPTH = 32  # nesting, every alias expanded


class _Unbounded(yaml.MarkedYAMLError):
    """A file past one of the bounds; `problem` says which, `problem_mark` where."""


class _BoundedLoader(Loader):
    """SafeLoader whose composer refuses documents past MAX_VALUES or MAX_DEPTH, and which
    reads YAML 1.2's exponent floats (`1e3`, `1e-5`, `1.0e3`, `.5E3`) as floats."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        # id(node) → (values it stands for, depth it reaches), once the node is complete.
        self._measured: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        mark = self.peek_event().start_mark
        alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Unbounded(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is None:
            return None
        measured = self._measured.get(id(node))
        if measured is None:
            if alias:  # the anchored value is still being composed: it contains itself
                raise _Unbounded(None, None, "an alias refers to a value that contains it", mark)
            measured = self._measured[id(node)] = self._measure(node)
        values, depth = measured
        if values > MAX_VALUES:
            raise _Unbounded(
                None, None, f"its aliases expand to more than {MAX_VALUES} values", mark
            )
        if self._depth + depth > MAX_DEPTH:
            raise _Unbounded(None, None, f"its aliases nest deeper than {MAX_DEPTH} levels", mark)
        return node

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        """(values, depth) of a node whose children are all measured."""
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            return 1, 1
        measured = [self._measured[id(child)] for child in children]
        return 1 + sum(v for v, _ in measured), 1 + max((d for _, d in measured), default=0)


def read_text(path: Path) -> str:
    """A recipe file's text: a regular file of at most MAX_BYTES of UTF-8."""
    try:
        with open_regular(path) as handle:
            data = handle.read(MAX_BYTES + 1)
    except UsageError as exc:
        raise RecipeError([f"{exc.message} — pass the path of a recipe YAML file"]) from None
    if len(data) > MAX_BYTES:
        raise RecipeError(
            [f"{path}: larger than {MAX_BYTES >> 10} KiB — a recipe is a few kilobytes of YAML"]
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            [f"{path}: not UTF-8 text (byte {exc.start}) — a recipe is a YAML text file"]
        ) from None


def read_yaml(path: Path, problems: list[str]) -> tuple[Any, Origins]:
    """The document in `path` and the (file, line) of every key; duplicate keys → problems."""
    loader = _BoundedLoader(read_text(path))
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _Unbounded as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 1
        raise RecipeError(
            [
                f"{path}:{line}: refused: {exc.problem} — a recipe is a few dozen keys a few "
                "levels deep; write its values out"
            ]
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        # The problem alone: str(exc) would quote the file's lines back.
        reason = getattr(exc, "problem", None) or type(exc).__name__
        raise RecipeError([f"{path}:{line}: invalid YAML: {reason} — fix the syntax"]) from None
    finally:
        loader.dispose()
    origins: Origins = {}
    if root is not None:
        _walk(root, (), path, origins, problems)
    return data, origins


def _walk(node: yaml.Node, key: Key, file: Path, origins: Origins, problems: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k_node, v_node in node.value:
            name = str(k_node.value)
            child = (*key, name)
            line = k_node.start_mark.line + 1
            if name in seen:
                dotted = ".".join(map(str, child))
                problems.append(f"{file}:{line}: {dotted}: duplicate key — write each key once")
            seen.add(name)
            origins[child] = (file, line)
            _walk(v_node, child, file, origins, problems)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*key, index)
            origins[child] = (file, item.start_mark.line + 1)
            _walk(item, child, file, origins, problems)
