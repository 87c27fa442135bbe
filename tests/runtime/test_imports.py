"""What transformers imports only because it is installed, skipped by the report's float half
(runtime/base/imports.py): each case in a process of its own, as sys.modules is a process's."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, *args: str) -> str:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True,
                          check=True, timeout=300).stdout  # fmt: skip


def test_transformers_model_classes_load_without_scikit_learn_which_stays_importable() -> None:
    out = _run(
        "import sys\n"
        "from kiln.runtime.base.imports import unused_imports_skipped\n"
        "with unused_imports_skipped():\n"
        "    from transformers import AutoModelForCausalLM\n"
        "    import transformers.generation.candidate_generator\n"
        "print('sklearn' in sys.modules, 'scipy.stats' in sys.modules)\n"
        "import sklearn.metrics\n"  # a gate's lm-eval metrics, later in the same process
        "print(sklearn.metrics.f1_score([0, 1], [0, 1]))\n"
    )
    assert out.split() == ["False", "False", "1.0"]


def test_the_float_half_does_not_load_scikit_learn() -> None:
    code = "import sys; from kiln.quant.reference import prepare; prepare()\n"
    assert _run(code + "print('sklearn' in sys.modules)").split() == ["False"]
