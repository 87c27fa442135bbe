"""RecipeError: every problem found in one recipe, each a formatted `file:line: key:
problem — what is allowed` line, reported together (exit 2)."""

from __future__ import annotations

from kiln.runtime.base.errors import UsageError


class RecipeError(UsageError):
    """One or more problems in a recipe; `problems` holds each formatted line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        header = f"{count} problem{'s' if count != 1 else ''} in recipe:"
        super().__init__("\n".join([header, *("  " + p for p in self.problems)]))
