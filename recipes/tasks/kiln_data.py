"""The data of kiln's offline tasks, for lm-eval's `custom_dataset`: each task YAML names
`custom_dataset: !function kiln_data.load` and its JSONL file in `dataset_kwargs.data_file`,
found beside this module. lm-eval resolves `!function` next to the YAML, so stock
`lm_eval --include_path recipes/tasks` reads the tasks from any working directory (a plain
`data_files` path would be resolved against the working directory instead).
"""

from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(data_file: str, **_metadata: object) -> datasets.DatasetDict:
    """The task's one split, `test`, from `data_file` beside this module (lm-eval also passes
    the task's metadata, such as its version, which the data does not depend on)."""
    dataset = datasets.load_dataset("json", data_files={"test": str(HERE / data_file)})
    assert isinstance(dataset, datasets.DatasetDict)
    return dataset
