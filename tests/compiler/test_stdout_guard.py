"""`--json` commands keep stdout for their one JSON object, whatever the libraries print."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os
    from kiln.compiler.cli.stdout_guard import stdout_to_stderr

    with stdout_to_stderr():
        print("a library's progress line")
        os.write(1, b"native text on descriptor 1\\n")
    print(json.dumps({"artifact": "a"}))
""")


def test_prints_and_descriptor_writes_go_to_stderr_while_guarded() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == {"artifact": "a"}
    assert "a library's progress line" in done.stderr
    assert "native text on descriptor 1" in done.stderr


def test_a_disabled_guard_leaves_stdout_alone() -> None:
    script = SCRIPT.replace("stdout_to_stderr()", "stdout_to_stderr(False)")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[0] == "a library's progress line"
