"""schemathesis fuzzes the server's own OpenAPI spec: no request may produce a 5xx.

Driven through hypothesis directly (one strategy per operation), bounded to a few examples
per operation on a tiny context (64 tokens) so it runs in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from kiln.runtime.server import NativeBackend, ServerConfig, create_app
from tests.serve.conftest import MODEL, LiveServer, tiny_engine

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = int(__import__("os").environ.get("KILN_FUZZ_EXAMPLES", "10"))


def test_no_request_is_a_server_error(tiny_llama: Path) -> None:
    from schemathesis.checks import not_a_server_error

    engine = tiny_engine(tiny_llama, max_model_len=64)
    config = ServerConfig(MODEL, max_running=engine.config.max_num_seqs, max_waiting=8)
    server = LiveServer(create_app(NativeBackend(engine), config)).start()
    try:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        paths = {op.path for op in operations}
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case: Any) -> None:
                case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=30)

            fuzz()
        assert server.state.in_flight == 0
    finally:
        server.stop()
