"""A recipe's `extends:` chain: the files it builds on, merged key by key (the recipe's own
keys win), with the file and line of every key kept, within bounds no chain can pass."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.reader import Key, Origins, read_yaml
from kiln.compiler.recipe.schema import RecipeModel

RECIPE_SUFFIXES = (".yaml", ".yml")


MAX_EXTENDS = 16  # files in one chain


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_chain(
    path: Path, chain: list[Path], problems: list[str], via: str = ""
) -> tuple[dict[str, Any], Origins, list[Path]]:
    """A recipe merged over the files it extends; `via`: `file:line` of the `extends:` that
    named this file (empty for the recipe itself)."""
    path = path.resolve()
    if path in chain:
        cycle = " → ".join(str(p) for p in [*chain, path])
        raise RecipeError([f"{chain[-1]}: extends: cycle {cycle} — a recipe cannot extend itself"])
    if len(chain) >= MAX_EXTENDS:
        raise RecipeError([f"{via}: extends: more than {MAX_EXTENDS} files deep — "
                           "flatten the chain"])  # fmt: skip
    data, origins = read_yaml(path, problems)
    recipe_keys = {"extends", *RecipeModel.model_fields}
    if via and (not isinstance(data, dict) or not data or set(data) - recipe_keys):
        # Say nothing of what the file holds: `extends` must not become a way to print files.
        raise RecipeError([f"{via}: extends: {path} is not a kiln recipe (a YAML mapping of "
                           "recipe keys only) — extend a recipe file"])  # fmt: skip
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"{path}:1: a recipe is a YAML mapping (key: value), not {type(data).__name__}"]
        )
    files = [path]
    parent = data.pop("extends", None)
    if parent is None:
        return data, origins, files
    line = origins.get(("extends",), (path, 1))[1]
    if not isinstance(parent, str):
        raise RecipeError(
            [f"{path}:{line}: extends: must be one file path — e.g. extends: base.yaml"]
        )
    base_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    if base_path.suffix.lower() not in RECIPE_SUFFIXES:
        raise RecipeError([f"{path}:{line}: extends: {parent!r} is not a recipe file "
                           "(.yaml or .yml) — extend a kiln recipe"])  # fmt: skip
    if not base_path.is_file():
        raise RecipeError(
            [
                f"{path}:{line}: extends: {parent!r} not found (looked for {base_path}) — "
                "give a path relative to this recipe"
            ]
        )
    base, base_origins, base_files = load_chain(
        base_path, [*chain, path], problems, f"{path}:{line}"
    )
    # Where the child sets a non-mapping value, the base's whole subtree under it is replaced.
    replaced = [k for k in origins if not isinstance(get_key(data, k), dict)]
    merged_origins = {
        k: v
        for k, v in base_origins.items()
        if not any(len(k) > len(r) and k[: len(r)] == r for r in replaced)
    }
    merged_origins.update({k: v for k, v in origins.items() if k != ("extends",)})
    return _merge(base, data), merged_origins, [path, *base_files]


def get_key(data: Any, key: Key) -> Any:
    for part in key:
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and part < len(data)
        if in_dict or in_list:
            data = data[part]
        else:
            return None
    return data
