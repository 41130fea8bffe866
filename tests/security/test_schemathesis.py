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
import re
import secrets
from collections import Counter
from typing import Any
from urllib.parse import quote

import httpx
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from access_helpers import Tenant, sql, template_and_sandbox

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


# With real ids in the path, only what neither boots a VM nor changes what other tests of the session use
# (the stack's tenant's quota, deletes): reads, and writes that a suspended sandbox refuses or that stay on
# the test's own rows.
_KNOWN_POSTS = ("/exec", "/timeout", "/schedules", "/files/mkdir", "/computer/mouse", "/computer/keyboard",
                "/computer/screenshot")


def _live_node(stack: Any) -> str:
    """The id of a node whose data plane answers: the session's database also holds the rows of nodes other
    modules made up (unreachable addresses), and a snapshot on one of those would make a diff answer 503."""
    for row in sql(stack, "SELECT id, dataplane_url FROM nodes WHERE state = 'ready' ORDER BY id"):
        try:
            if httpx.get(f"{row['dataplane_url']}/healthz", timeout=2).status_code == 200:
                return str(row["id"])
        except httpx.HTTPError:
            continue
    raise AssertionError("the stack has no node whose data plane answers")


def _objects(stack: Any) -> dict[str, str]:
    """Rows of the stack's (operator) tenant for generated requests to find: a suspended sandbox with two
    snapshots and a schedule, its template, a volume, a credential."""
    me = Tenant(name="dev", tenant_id=stack.tenant_id, key=stack.api_key, api_url=stack.api_url)
    tpl, sbx = template_and_sandbox(stack, me)
    snaps = [f"snap_{secrets.token_hex(10)}" for _ in range(2)]
    node = _live_node(stack)  # snapshots live on a node
    for s in snaps:
        sql(stack, "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, state, generation) "
            "VALUES ($1, $2, $3, $4, 'full', 'ready', 1)", s, me.tenant_id, sbx, node)
    with me.http() as c:
        vol = f"fuzz-{secrets.token_hex(3)}"
        assert c.post("/v1/volumes", json={"name": vol, "size_bytes": 1 << 24}).status_code == 201
        cred = f"fuzz-{secrets.token_hex(3)}"
        assert c.post("/v1/credentials", json={"name": cred, "value": "v" * 20, "hosts": ["x.example"]}
                      ).status_code == 201
        sched = c.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "0 0 1 1 *"}).json()["id"]
    return {"sandbox_id": sbx, "snapshot_a": snaps[0], "snapshot_b": snaps[1], "schedule_id": sched,
            "template": tpl, "volume": vol, "credential": cred}


def _known(op: Any, objects: dict[str, str]) -> dict[str, str] | None:
    """Real path parameters for ``op``, or None where the known pass leaves it out (see ``_KNOWN_POSTS``)."""
    path, method = op.path, op.method.upper()
    if method not in ("GET", "PUT") and not (method == "POST" and path.endswith(_KNOWN_POSTS)):
        return None
    if "{tenant}" in path or "{" not in path:
        return None
    names = set(re.findall(r"{([^}]+)}", path))
    values = {k: v for k, v in objects.items() if k in names}
    if "name" in names:
        values["name"] = objects["volume" if path.startswith("/v1/volumes/") else
                                 "credential" if path.startswith("/v1/credentials/") else "template"]
    return values if set(values) == names or names - set(values) <= {"port"} else None


def test_no_server_errors(stack: Any) -> None:
    """Every operation of the served schema (less ``EXCLUDED``), ``EXAMPLES`` generated requests each of
    valid and of invalid data (which must be 4xx), and of valid data on real objects of the caller's tenant
    (``_known``): none answers 5xx. Failures are collected over all operations, one line each (the first
    failing request)."""
    headers = {"authorization": f"Bearer {stack.api_key}"}
    operations = _operations(stack)
    assert len(operations) >= 50
    objects = _objects(stack)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for op in operations:
        known = _known(op, objects)
        passes: list[tuple[str, Any]] = [(m.value, op.as_strategy(generation_mode=m))
                                          for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        if known:
            # auto_resume=false: waking the suspended sandbox would boot a VM (this test runs without any).
            passes.append(("known ids", op.as_strategy(path_parameters=known, query={"auto_resume": "false"})))
        for mode, strategy in passes:

            @given(case=strategy)
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
            except (Exception, BaseExceptionGroup) as exc:  # one line per operation and pass: the first failure
                failures.append(f"{op.label} ({mode}): {' '.join(str(exc).split())[:400]}")
    print(f"schemathesis: {len(operations)} operations, {sum(statuses.values())} requests, "
          f"statuses {dict(sorted(statuses.items()))}, {len(failures)} failing")
    assert not failures, "\n".join(failures)


# E2B's answers by design in the 5xx range: envd for a sandbox that is not running (502, what its SDK reads as
# "not running").
_E2B_5XX_BY_DESIGN = ("/e2b/envd/",)
_MALFORMED: list[dict[str, Any]] = [
    {"content": b"{", "headers": {"content-type": "application/json"}},
    {"json": []},
    {"json": {"templateID": 5, "timeout": "x", "name": ["x"], "tags": "x", "volumeMounts": [{"name": 1}],
              "allowOut": "x", "value": {"a": 1}, "target": None, "count": -1}},
    {"content": b"\xff\xfe\x00garbage", "headers": {"content-type": "application/octet-stream"}},
]
_ODD_IDS = ["x" * 300, "..", "%2e%2e", "a b", "ü", "0", "-1"]


def test_e2b_routes_refuse_malformed_requests_without_5xx(stack: Any) -> None:
    """E2B's routes are not in the OpenAPI schema (docs/e2b.md), so schemathesis does not reach them: every
    one of them (read from the app, as tests/security/test_route_enumeration.py does) gets malformed bodies
    and odd ids, and answers 4xx."""
    from test_route_enumeration import ROUTES

    routes = [r for r in ROUTES if r.path.startswith("/e2b/") and not r.path.startswith(_E2B_5XX_BY_DESIGN)]
    assert len(routes) >= 30
    failures: list[str] = []
    headers = {"authorization": f"Bearer {stack.api_key}", "x-api-key": stack.api_key}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as c:
        for route in routes:
            for odd in _ODD_IDS:
                url = re.sub(r"{[^}]+}", quote(odd, safe="%."), route.path)
                for extra in _MALFORMED if route.method in ("POST", "PUT", "PATCH", "DELETE") else [{}]:
                    r = c.request(route.method, url, **{k: v for k, v in extra.items() if k != "headers"},
                                  headers=extra.get("headers"))
                    if r.status_code >= 500:
                        failures.append(f"{route.method} {url} {str(extra)[:80]}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures[:40])
