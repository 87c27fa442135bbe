"""The native kernels' tests on the build another kind of CPU gets (slow: one more build).

A CPU with AVX-512 builds the kernels' AVX-512 and AMX paths; the paths a CPU without them
takes (AVX2 and FMA: a Zen 3 EPYC) would go untested wherever the suite runs on such a CPU.
`KILN_NATIVE_MARCH=x86-64-v3` builds the kernels for that level instead
(runtime/engine/native/__init__.py), and the kernel tests run against that build in a child pytest.
The same by hand for AVX-512 without BF16 (Skylake to Ice Lake servers):

    KILN_NATIVE_MARCH=skylake-avx512 pytest tests/runtime/test_native_attention.py \\
        tests/runtime/test_native_elementwise.py tests/runtime/test_quantized.py \\
        tests/runtime/test_dense_linear.py tests/runtime/test_greedy_head.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime.engine import native

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/runtime/test_native_attention.py",
    "tests/runtime/test_native_elementwise.py",
    "tests/runtime/test_quantized.py",
    "tests/runtime/test_dense_linear.py",
    "tests/runtime/test_greedy_head.py",
]


@pytest.mark.slow(minutes=1.4)
@pytest.mark.skipif(
    not native.available() or "avx512f" not in native.this_cpus_flags().split(),
    reason="needs the native kernels on a CPU with AVX-512 (elsewhere this CPU's own build "
    "already takes the AVX2 paths)",
)
def test_the_kernel_tests_pass_on_the_build_for_an_avx2_cpu() -> None:
    env = dict(os.environ, KILN_NATIVE_MARCH="x86-64-v3", PYTHONPATH=str(ROOT))
    check = "from kiln.runtime.engine import native; import torch; native.available(); "
    check += "print(torch.ops.kiln.amx_ready(), torch.ops.kiln.bf16_flushes_subnormals())"
    built = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split() == ["False", "False"]  # neither AMX nor AVX512-BF16 in it
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
