"""A fuzz run of the documented API (schemathesis, from /openapi.json): generated requests for
every operation, valid and not, against the app behind a real uvicorn; none may answer 5xx."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from routereplay.service import Settings, create_app

# The schema is read from the app itself (no lifespan needed): what /openapi.json serves.
schema = schemathesis.openapi.from_dict(create_app(Settings(backend="synthetic")).openapi())

_BASE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _server(request: pytest.FixtureRequest) -> None:
    live = request.getfixturevalue("live_server_module")
    _BASE["url"] = live.url


@schema.parametrize()
@hypothesis.settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure reproduces
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_no_5xx_for_any_generated_request(case: schemathesis.Case) -> None:
    response = case.call(base_url=_BASE["url"], timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
