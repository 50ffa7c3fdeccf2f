"""The OpenAPI document says what the API accepts and answers, and the API keeps to it: request bodies of the
generation routes, the bearer scheme, each route's error statuses, 405s naming every allowed method; then
schemathesis over every operation of the document, with a tenant key and an admin key, failing on any 5xx
or any response its declared schema does not describe.

Runs against test_gateway's app (real Redis, SQLite, tokenizer; scripted worker pools).
"""

from __future__ import annotations

import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from tessera import tenancy
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE

# test_gateway's app fixture and the Redis it runs on; `name as name` re-exports them to pytest.
from test_gateway import redis_url as redis_url
from test_gateway import reply
from test_gateway import stack as stack

GENERATION = ("/v1/chat/completions", "/v1/completions")
# Bounded for CI: about 40 operations x 2 keys.
EXAMPLES_PER_OPERATION = 5
EXAMPLES_PER_GENERATION_ROUTE = 40
ERROR_STATUSES = {"400", "401", "403", "404", "413", "415", "429", "503"}


@pytest.fixture(scope="module")
def admin_key(stack) -> str:
    with stack.sessions() as session:
        tenancy.create_tenant(session, "openapi-admins")
        _, key = tenancy.create_key(session, "openapi-admins", scopes=(SCOPE_ADMIN, SCOPE_INFERENCE))
    return key


@pytest.fixture(scope="module")
def document(stack) -> dict:
    response = stack.client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_generation_routes_declare_their_bodies_security_and_error_statuses(document):
    schemas = document["components"]["schemas"]
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a Tessera API key (tessera keys create)",
    }
    for path, model in zip(GENERATION, ("ChatCompletionRequest", "CompletionRequest"), strict=True):
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert operation["security"] == [{"bearerAuth": []}]
        assert set(operation["responses"]) >= ERROR_STATUSES
        for status in ERROR_STATUSES:
            schema = operation["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in operation["responses"]  # validation errors are 400s
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["temperature"]["anyOf"][0] == {"maximum": 2.0, "minimum": 0.0, "type": "number"}
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert document["paths"]["/healthz"]["get"].get("security") is None


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/admin/deployments/@test/x", "GET, PATCH"),
        ("PATCH", "/admin/deployments/@test/x/audit", "GET"),
        ("PUT", "/admin/deployments/@test/x/audit", "GET"),
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/admin/tenants/acme", "GET, PATCH"),
    ],
)
def test_a_405_lists_every_method_the_path_allows(stack, admin_key, method, path, allowed):
    response = stack.client.request(method, path, headers=stack.auth(admin_key), json={})
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_no_operation_answers_a_server_error_or_breaks_its_schema(stack, admin_key, document):
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 40
    calls = []

    def check(case) -> None:
        stack.live()
        stack.pools.script = reply()
        body = case.body
        # Half the generation bodies name the test model, so fuzzed parameters reach the worker and back.
        if isinstance(body, dict) and case.path in GENERATION and zlib.crc32(repr(body).encode()) % 2:
            body["model"] = stack.model
        for key in (stack.key, admin_key):
            kwargs = case.as_transport_kwargs(base_url="http://testserver", headers=stack.auth(key))
            data = kwargs.get("data")
            form = data if isinstance(data, dict) else None
            response = stack.client.request(
                kwargs["method"],
                kwargs["url"],
                headers=kwargs.get("headers"),
                params=kwargs.get("params"),
                content=None if form is not None else data,
                data=form,
                json=kwargs.get("json"),
            )
            calls.append((case.path, response.status_code))
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    for operation in operations:
        examples = EXAMPLES_PER_GENERATION_ROUTE if operation.path in GENERATION else EXAMPLES_PER_OPERATION
        run = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )(given(operation.as_strategy())(check))
        run()
    assert len(calls) >= 2 * len(operations)
    # Some fuzzed generation bodies were valid and went through the worker and back.
    assert {status for path, status in calls if path in GENERATION} >= {200, 400, 404}
