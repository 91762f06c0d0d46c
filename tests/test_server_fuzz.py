"""A bounded schemathesis run against the server's own OpenAPI document: whatever the
generated bodies, no 5xx."""

from __future__ import annotations

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.engine_harness import make_engine


@pytest.fixture(scope="module")
def api_schema(tiny_llama):
    engine = make_engine(
        load_model(tiny_llama, torch.float32), max_slots=4, kv_pool_tokens=4096, max_model_len=1024
    ).start()
    running = start_server(create_app(engine), "127.0.0.1", 0)
    yield schemathesis.openapi.from_url(running.url + "/openapi.json")
    running.stop()
    engine.shutdown()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)
