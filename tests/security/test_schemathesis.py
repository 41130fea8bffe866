"""No request makes the API answer 5xx (docs/SECURITY.md, "Tenant vs tenant"): schemathesis generates requests
from the OpenAPI schema the running API serves and checks ``not_a_server_error`` on each answer.

Bounded to about two minutes: a few examples per operation, generated (not explicit) examples only, no
shrinking; with the operator tenant's key (the stack's), so operator-only routes are exercised too. Left
out, with the reason:

- ``POST /v1/sandboxes``, ``POST /v1/templates``, ``PUT /v1/pools/{template}``: they would boot microVMs
  or build templates (this test runs without VMs); their validation is covered by the integration tests.
- ``GET /v1/events`` (with ``follow``) and ``POST .../exec/stream``: streaming answers that end only when
  the client goes.
- ``GET /v1/sandboxes/{sandbox_id}/computer/cdp``: a WebSocket.
- ``POST /v1/nodes/{node_id}/drain`` and ``/undrain``: a generated node id that happened to be this
  stack's node would drain the stack under the other tests.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

# Examples per operation and generation mode (PODBAY_SCHEMATHESIS_EXAMPLES for a longer exploration).
EXAMPLES = int(os.environ.get("PODBAY_SCHEMATHESIS_EXAMPLES", "5"))

EXCLUDED = [
    ("POST", "/v1/sandboxes"),
    ("POST", "/v1/templates"),
    ("PUT", "/v1/pools/{template}"),
    ("GET", "/v1/events"),
    ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream"),
    ("GET", "/v1/sandboxes/{sandbox_id}/computer/cdp"),
    ("POST", "/v1/nodes/{node_id}/drain"),
    ("POST", "/v1/nodes/{node_id}/undrain"),
]


def _operations(stack: Any) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{stack.api_url}/openapi.json")
    for method, path in EXCLUDED:
        schema = schema.exclude(method=method, path=path)
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_errors(stack: Any) -> None:
    """Every operation of the served schema (less ``EXCLUDED``), ``EXAMPLES`` generated requests each of
    valid and of invalid data (which must be 4xx): none answers 5xx. Failures are collected over all
    operations, one line each (the first failing request)."""
    headers = {"authorization": f"Bearer {stack.api_key}"}
    operations = _operations(stack)
    assert len(operations) >= 50
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], derandomize=True,
                      database=None, suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                response = case.call(headers=headers, timeout=30)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=[not_a_server_error])

            try:
                run()
            except Unsatisfiable:  # no invalid value exists (a plain string path parameter, no parameters)
                continue
            except Exception as exc:  # one line per operation and mode: the first failing request
                failures.append(f"{op.label} ({mode.value}): {' '.join(str(exc).split())[:400]}")
    print(f"schemathesis: {len(operations)} operations, {sum(statuses.values())} requests, "
          f"statuses {dict(sorted(statuses.items()))}, {len(failures)} failing")
    assert not failures, "\n".join(failures)
