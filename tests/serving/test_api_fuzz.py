"""Schemathesis generates requests from the app's own OpenAPI document; no input may cause a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from service.api.app import create_app
from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def live(default_model):
    # a short context bounds the work of any generated request
    with LiveServer(default_model, {"max_model_len": 48, "max_num_seqs": 8}) as s:
        yield s


# the document is the app's own; building the app loads no model
schema = schemathesis.openapi.from_dict(create_app().openapi())
# bodies that fit the document (huge integers, odd floats, long strings) and bodies that break it (wrong
# types, missing fields): each must get its 2xx or 4xx; tests/serving/test_reliability.py adds every field's boundaries
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_causes_a_server_error(case, live):
    response = case.call(base_url=live.url, timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
