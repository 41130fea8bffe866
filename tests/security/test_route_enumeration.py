"""Tenant vs tenant, for every route of the API (docs/SECURITY.md, "Tenant vs tenant").

The routes are read from the app itself (``app.routes``: the OpenAPI operations and the E2B routes the
schema leaves out), so a route added later is enumerated without touching this file. Tenant A makes one
object of each kind (a sandbox row, an operation, a snapshot row, a template and its builds, a volume, a
schedule, a webhook, a credential, an API key); tenant B then calls every route with A's ids in every path
parameter (and A's names in the body and query where a route takes them). Each answer must be 404 or 403
(or 401 / 422 where the route refuses earlier), never 2xx, never 5xx, and must not carry A's data. Routes
without a path parameter (listings, creates) may answer B 2xx about B's own objects, but never show A's.

Routes that legitimately answer anyone the same are in ``EXEMPT`` with the reason.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from access_helpers import Tenant, new_tenant, sql, template_and_sandbox
from podbay.config import Settings
from podbay_api.app import create_app

REFUSALS = {401, 403, 404, 422}  # 422: a parameter refused before the lookup (never reached A's object)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    in_schema: bool

    @property
    def id(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def params(self) -> list[str]:
        return re.findall(r"{([^}:]+)(?::[^}]*)?}", self.path)


def app_routes() -> list[Route]:
    """Every HTTP route of the API app (methods other than HEAD), OpenAPI's and hidden ones alike."""
    app = create_app(Settings())
    out: set[Route] = set()
    for r in app.routes:
        if isinstance(r, APIRoute):
            contexts: Iterator[Any] = iter([r])
        elif hasattr(r, "effective_route_contexts"):  # FastAPI >= 0.165: included routers stay lazy
            contexts = r.effective_route_contexts()
        else:  # /openapi.json, /docs: FastAPI's own pages
            continue
        for c in contexts:
            for method in set(getattr(c, "methods", None) or ()) - {"HEAD"}:
                out.add(Route(method, c.path, bool(c.include_in_schema)))
    return sorted(out, key=lambda r: (r.path, r.method))


ROUTES = app_routes()

# Routes that act on nothing of a tenant's, or on what all tenants share, with the reason.
EXEMPT = {
    "GET /healthz": "liveness probe; names no tenant object",
    "GET /readyz": "readiness probe; names no tenant object",
    "GET /metrics": "operator only (tests/security/test_metrics_access.py)",
    "GET /console/assets/{name}": "the web console's static files, the same for everyone; names no tenant object",
    "GET /.well-known/openid-configuration": "the workload identity issuer's metadata, the same for everyone "
    "(tests/security/test_workload_identity_access.py)",
    "GET /.well-known/jwks.json": "the issuer's public keys, the same for everyone "
    "(tests/security/test_workload_identity_access.py)",
}

# Routes without a path parameter whose body names one of A's objects to act on it (not a name for B's own
# new object): they must refuse too.
# (A build under A's template name is not one: template names are per tenant, so it names B's own new
# template; it must neither refuse with 409 nor show anything of A's.)
REFERS = {"POST /v1/sandboxes", "POST /e2b/sandboxes", "POST /e2b/v2/sandboxes",
          "POST /e2b/templates/tags", "DELETE /e2b/templates/tags"}

# Creates from B's own template that mount A's volume: the volume lookup must be the caller's tenant's.
MIXED_CREATES = {
    "POST /v1/sandboxes": lambda w: {"template": w.b_template,
                                     "volumes": [{"name": w.ids["volume_name"], "path": "/mnt/a"}]},
    "POST /e2b/sandboxes": lambda w: {"templateID": w.b_template,
                                      "volumeMounts": [{"name": w.ids["volume_name"], "path": "/mnt/a"}]},
    "POST /e2b/v2/sandboxes": lambda w: {"templateID": w.b_template,
                                         "volumeMounts": [{"name": w.ids["volume_name"], "path": "/mnt/a"}]},
}

# Creates that made B's own object named like A's: removed again (by B), so that later routes naming A's
# object by name find A's, not B's.
CLEANUP = {
    "POST /v1/volumes": lambda c, w, r: c.delete(f"/v1/volumes/{w.ids['volume_name']}"),
    "POST /e2b/volumes": lambda c, w, r: c.delete(f"/e2b/volumes/{r.json()['volumeID']}"),
    "POST /v1/credentials": lambda c, w, r: c.delete(f"/v1/credentials/{w.ids['credential']}"),
    "POST /v1/keys": lambda c, w, r: c.delete(f"/v1/keys/{r.json()['id']}"),
    "POST /v1/webhooks": lambda c, w, r: c.delete(f"/v1/webhooks/{r.json()['id']}"),
    "POST /v1/templates": lambda c, w, r: _drop_own_template(c, w),
}


def _drop_own_template(c: httpx.Client, w: World) -> httpx.Response:
    """Remove B's own template named like A's, when B's build made one (a build that failed made none), and
    B's build rows of that name (its build history is B's, and would answer B's later ``/builds`` call)."""
    r = c.delete(f"/v1/templates/{w.ids['template']}")
    sql(w.stack, "DELETE FROM template_builds WHERE tenant_id=$1 AND alias=$2", w.b.tenant_id, w.ids["template"])
    return httpx.Response(204) if r.status_code == 404 else r


@dataclass
class World:
    """Tenant A's objects, tenant B, and the markers of A's data that B must never see."""

    a: Tenant
    b: Tenant
    ids: dict[str, str]
    b_sandbox: str = ""
    b_template: str = ""
    secrets: set[str] = field(default_factory=set)
    stack: Any = None


def _columns(stack: Any, table: str) -> set[str]:
    rows = sql(stack, "SELECT column_name FROM information_schema.columns WHERE table_name=$1", table)
    return {r["column_name"] for r in rows}


@pytest.fixture(scope="module")
def world(stack: Any) -> World:
    a, b = new_tenant(stack, "tenant-a"), new_tenant(stack, "tenant-b")
    tpl, sbx = template_and_sandbox(stack, a)
    if "owner_tenant" in _columns(stack, "templates"):
        sql(stack, "UPDATE templates SET owner_tenant=$1 WHERE name=$2", a.tenant_id, tpl)
    node = sql(stack, "SELECT id FROM nodes ORDER BY id LIMIT 1")
    node_id = str(node[0]["id"]) if node else "node-1"
    op = f"op_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO operations (id, tenant_id, sandbox_id, kind, state) VALUES ($1, $2, $3, 'pause', 'succeeded')",
        op, a.tenant_id, sbx)
    snaps = [f"snap_{secrets.token_hex(10)}" for _ in range(2)]
    for s in snaps:
        sql(stack, "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation) "
            "VALUES ($1, $2, $3, 'full', 'ready', 1)", s, a.tenant_id, sbx)
    build = f"bld_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO template_builds (id, name, tenant_id, node_id, state, dockerfile) "
        "VALUES ($1, $2, $3, $4, 'failed', 'FROM base')", build, tpl, a.tenant_id, node_id)
    e2b_build = f"e2bbld_{secrets.token_hex(10)}"
    sql(stack, "INSERT INTO e2b_template_builds (id, template, tenant_id, state) VALUES ($1, $2, $3, 'error')",
        e2b_build, tpl, a.tenant_id)
    with a.http() as c:
        vol_name = f"avol-{secrets.token_hex(3)}"
        r = c.post("/v1/volumes", json={"name": vol_name, "size_bytes": 1 << 24})
        assert r.status_code == 201, r.text
        vol_id = r.json()["id"]
        cred = f"acred-{secrets.token_hex(3)}"
        r = c.post("/v1/credentials", json={"name": cred, "value": "a-secret-" + secrets.token_hex(8),
                                            "hosts": ["a-only.example.com"]})
        assert r.status_code == 201, r.text
        e2b_secret = c.post("/e2b/secrets", json={"name": f"asecret-{secrets.token_hex(3)}",
                                                   "value": "a-secret-" + secrets.token_hex(8)})
        assert e2b_secret.status_code == 201, e2b_secret.text
        key = c.post("/v1/keys", json={"name": "a-key"})
        assert key.status_code == 201, key.text
        hook = c.post("/v1/webhooks", json={"url": f"http://127.0.0.1:9/a-hook-{secrets.token_hex(4)}"})
        assert hook.status_code == 201, hook.text
        sched = c.post(f"/v1/sandboxes/{sbx}/schedules", json={"cron": "0 0 1 1 *"})
        assert sched.status_code == 201, sched.text
    ids = {"sandbox": sbx, "template": tpl, "operation": op, "snapshot_a": snaps[0], "snapshot_b": snaps[1],
           "build": build, "e2b_build": e2b_build, "volume_name": vol_name, "volume_id": vol_id,
           "credential": cred, "key_id": key.json()["id"], "webhook_id": hook.json()["id"],
           "webhook_url": hook.json()["url"], "schedule_id": sched.json()["id"], "tenant": a.tenant_id,
           "node_id": node_id, "e2b_secret_id": e2b_secret.json()["secretID"],
           "e2b_secret_name": e2b_secret.json()["name"]}
    markers = {a.tenant_id, a.name, sbx, op, *snaps, build, e2b_build, vol_id, key.json()["id"],
               hook.json()["id"], hook.json()["url"], sched.json()["id"], "a-only.example.com",
               e2b_secret.json()["secretID"]}
    b_tpl, b_sbx = template_and_sandbox(stack, b)
    if "owner_tenant" in _columns(stack, "templates"):
        sql(stack, "UPDATE templates SET owner_tenant=$1 WHERE name=$2", b.tenant_id, b_tpl)
    return World(a=a, b=b, ids=ids, secrets=markers, b_sandbox=b_sbx, b_template=b_tpl, stack=stack)


def _params(route: Route, w: World) -> list[dict[str, str]]:
    """Path parameter values to try for ``route``: A's objects (several variants where a parameter may name
    more than one kind of object)."""
    i = w.ids
    p = route.path
    by_name: dict[str, list[str]] = {
        "sandbox_id": [i["sandbox"]], "operation_id": [i["operation"]], "snapshot_a": [i["snapshot_a"]],
        "snapshot_b": [i["snapshot_b"]], "port": ["8080"], "template": [i["template"]], "key_id": [i["key_id"]],
        "webhook_id": [i["webhook_id"]], "node_id": [i["node_id"]], "tenant": [i["tenant"]],
        "schedule_id": [i["schedule_id"]], "files_hash": ["ab" * 32], "alias": [i["template"]],
        "volume_id": [i["volume_id"], i["volume_name"]],
        # E2B's template ids name templates, and snapshots (snap_...) where a route takes both.
        "template_id": [i["template"], i["snapshot_a"]],
        "build_id": [i["e2b_build"], i["build"]],
        "secret": [i["e2b_secret_id"], i["e2b_secret_name"]],  # E2B's secrets: by id or by name
    }
    if "/files/{files_hash}" in p:
        # A COPY step's upload: for a template of the caller's or a name nobody holds yet (B's new template);
        # a snapshot id is no template there, so only A's template is A's object.
        by_name["template_id"] = [i["template"]]
    if p.startswith("/v1/templates/"):
        by_name["name"] = [i["template"]]
    elif p.startswith("/v1/volumes/"):
        by_name["name"] = [i["volume_name"]]
    elif p.startswith("/v1/credentials/"):
        by_name["name"] = [i["credential"]]
    if p.startswith("/e2b/envd/"):
        by_name["path"] = ["filesystem.Filesystem/Stat", "files", "health"]
    elif p.startswith("/e2b/volumecontent/"):
        by_name["op"] = ["path", "dir", "file"]  # authorised by the volume's token, not a key: 401 for B
    else:  # the E2B fallback: an unknown route that names A's sandbox
        by_name["path"] = [f"sandboxes/{i['sandbox']}/nothing"]
    variants: list[dict[str, str]] = [{}]
    for name in route.params:
        values = by_name.get(name)
        assert values, f"{route.id}: no value of tenant A for path parameter {name!r}; add one to _params"
        variants = [{**v, name: value} for v in variants for value in values]
    return variants


def _mixed(route: Route, w: World) -> list[dict[str, str]]:
    """Variants with B's own sandbox in ``sandbox_id`` where the route names another object of A's too (in
    another path parameter or in its body): the lookup of that object must be the caller's tenant's."""
    if "sandbox_id" not in route.params or route.path.startswith("/e2b/envd/"):
        return []
    objects = set(route.params) - {"sandbox_id", "port", "files_hash", "path"}  # the others are A's objects
    if not objects and route.id not in MIXED_BODIES:
        return []
    others = _params(route, w)
    return [{**v, "sandbox_id": w.b_sandbox} for v in others]


# Bodies that name an object of A's beside the sandbox of the path.
MIXED_BODIES = {"POST /v1/sandboxes/{sandbox_id}/restore", "POST /v1/sandboxes/{sandbox_id}/fork",
                "POST /v1/sandboxes/{sandbox_id}/computer/fill"}


def _request(route: Route, w: World, values: dict[str, str]) -> dict[str, Any]:
    """Keyword arguments of ``httpx.Client.request`` for B's call: A's names in the body and query."""
    i = w.ids
    url = re.sub(r"{([^}:]+)(?::[^}]*)?}", lambda m: values[m.group(1)], route.path)
    key = f"{route.method} {route.path}"
    query: dict[str, Any] = {}
    body: Any = None
    content: bytes | None = None
    files: Any = None
    if "/files" in route.path and route.path.startswith("/v1/"):
        query["path"] = "/etc/hostname"
        content = b"x" if route.method == "PUT" else None
    bodies: dict[str, Any] = {
        "POST /v1/sandboxes": {"template": i["template"]},
        "POST /v1/sandboxes/{sandbox_id}/timeout": {"lease_s": 60},
        "POST /v1/sandboxes/{sandbox_id}/exec": {"argv": ["true"]},
        "POST /v1/sandboxes/{sandbox_id}/exec/stream": {"argv": ["true"]},
        "POST /v1/sandboxes/{sandbox_id}/snapshots": {},
        "POST /v1/sandboxes/{sandbox_id}/restore": {"snapshot_id": i["snapshot_a"]},
        "POST /v1/sandboxes/{sandbox_id}/fork": {"snapshot_id": i["snapshot_a"]},
        "PUT /v1/sandboxes/{sandbox_id}/ports/{port}": {"public": True},
        "POST /v1/sandboxes/{sandbox_id}/computer/mouse": {"action": "move", "x": 1, "y": 1},
        "POST /v1/sandboxes/{sandbox_id}/computer/keyboard": {"action": "type", "text": "x"},
        "POST /v1/sandboxes/{sandbox_id}/computer/fill": {"credential": i["credential"], "selector": "#x"},
        "POST /v1/sandboxes/{sandbox_id}/computer/screenshot": {},
        "POST /v1/sandboxes/{sandbox_id}/suspend": {},
        "POST /v1/sandboxes/{sandbox_id}/pause": {},
        "POST /v1/sandboxes/{sandbox_id}/resume": {},
        "PUT /v1/pools/{template}": {"size": 0},
        "PUT /v1/sandboxes/{sandbox_id}/network": {},
        "PUT /v1/templates/{name}/network": {},
        "PUT /v1/tenants/{tenant}/quota": {"sandboxes": 1000},
        "POST /v1/sandboxes/{sandbox_id}/schedules": {"cron": "0 0 1 1 *"},
        "POST /v1/volumes/{name}/restore": {"snapshot_id": "vsnap_" + "0" * 20},
        "POST /v1/nodes/{node_id}/drain": {},
        "POST /v1/nodes/{node_id}/undrain": {},
        # Routes without a path parameter: B's own object, named like A's.
        "POST /v1/volumes": {"name": i["volume_name"], "size_bytes": 1 << 24},
        "POST /v1/credentials": {"name": i["credential"], "value": "b-value-" + "x" * 12, "hosts": ["b.example"]},
        "POST /v1/keys": {"name": "a-key"},
        "POST /v1/webhooks": {"url": "http://127.0.0.1:9/b-hook"},
        "POST /e2b/sandboxes": {"templateID": values.get("template_id", i["template"])},
        "POST /e2b/v2/sandboxes": {"templateID": i["snapshot_a"]},
        "POST /e2b/sandboxes/{sandbox_id}/timeout": {"timeout": 60},
        "POST /e2b/sandboxes/{sandbox_id}/refreshes": {"duration": 60},
        "POST /e2b/sandboxes/{sandbox_id}/pause": {},
        "POST /e2b/sandboxes/{sandbox_id}/connect": {"timeout": 60},
        "POST /e2b/v2/sandboxes/{sandbox_id}/connect": {"timeout": 60},
        "POST /e2b/sandboxes/{sandbox_id}/resume": {"timeout": 60},
        "POST /e2b/sandboxes/{sandbox_id}/fork": {},
        "POST /e2b/sandboxes/{sandbox_id}/snapshots": {},
        "PUT /e2b/sandboxes/{sandbox_id}/network": {"allowOut": ["a.example.com"]},
        "POST /e2b/v2/templates/{template_id}/builds/{build_id}": {"fromImage": "alpine:3", "steps": []},
        "POST /e2b/templates/tags": {"target": f"{i['template']}:default", "tags": ["b-tag"]},
        "DELETE /e2b/templates/tags": {"name": i["template"], "tags": ["default"]},
        "POST /e2b/volumes": {"name": i["volume_name"]},
        "POST /e2b/v3/templates": {"name": i["template"]},
        "POST /e2b/secrets/{secret}": {"value": "b-value"},
    }
    if key in bodies:
        body = bodies[key]
    if key == "POST /v1/templates":
        files = {"name": (None, i["template"]), "dockerfile": (None, "FROM base\n")}
    if key == "PUT /e2b/templates/{template_id}/files/{files_hash}/upload":
        query = {"t": w.ids["tenant"], "e": "9999999999", "s": "0" * 64}
        content = b"x"
    if key == "GET /v1/events":
        query = {"sandbox": i["sandbox"]}
    if key == "GET /v1/audit":
        query = {"sandbox_id": i["sandbox"], "limit": 1000}
    if key == "GET /e2b/snapshots":
        query = {"sandboxID": i["sandbox"]}
    if key in ("GET /v1/sandboxes", "GET /v1/keys"):
        query = {"all": "true"}
    kw: dict[str, Any] = {"params": query}
    if files is not None:
        kw["files"] = files
    elif content is not None:
        kw["content"] = content
    elif body is not None:
        kw["json"] = body
    return {"method": route.method, "url": url, **kw}


def _sent(req: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in req.items() if k != "method"}, default=str)


def _leaks(text: str, req: dict[str, Any], w: World) -> list[str]:
    """Markers of A's data in ``text`` that B did not send itself."""
    sent = _sent(req)
    return sorted(m for m in w.secrets if m in text and m not in sent)


def test_routes_are_read_from_the_app_and_cover_the_schema() -> None:
    """The enumeration holds every OpenAPI operation and the E2B routes the schema leaves out."""
    spec = create_app(Settings()).openapi()
    ops = {f"{m.upper()} {p}" for p, item in spec["paths"].items() for m in item}
    ids = {r.id for r in ROUTES}
    assert ops <= ids, sorted(ops - ids)
    hidden = [r for r in ROUTES if not r.in_schema and r.path.startswith("/e2b/")]
    assert len(hidden) >= 30 and "POST /e2b/envd/{sandbox_id}/{path:path}" in ids
    print(f"routes enumerated: {len(ROUTES)} ({len(ops)} in the OpenAPI schema, {len(ROUTES) - len(ops)} not)")


@pytest.mark.parametrize("route", ROUTES, ids=[r.id for r in ROUTES])
def test_another_tenants_objects_are_not_found(stack: Any, world: World, route: Route,
                                               request: pytest.FixtureRequest) -> None:
    if route.id in EXEMPT:
        pytest.skip(EXEMPT[route.id])
    problems: list[str] = []
    headers = {"authorization": f"Bearer {world.b.key}", "x-api-key": world.b.key}
    cases = [(v, False) for v in _params(route, world)] + [(v, True) for v in _mixed(route, world)]
    if route.id in MIXED_CREATES:
        cases.append(({}, True))
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=60) as client:
        for values, mixed in cases:
            req = _request(route, world, values)
            if mixed and route.id in MIXED_CREATES:
                req["json"] = MIXED_CREATES[route.id](world)
            if route.method == "POST" and route.path == "/v1/sandboxes":
                req["params"] = {**req["params"], "wait": "false"}
            r = client.request(**req)
            where = f"{req['method']} {req['url']}" + (" (B's sandbox or template, A's other object)" if mixed else "")
            print(f"{where}: {r.status_code} {r.text[:160]}")  # shown with -s: what each case got
            # B's own sandbox may be refused for its state (400, 409) before the other object is looked up.
            allowed = REFUSALS | ({400, 409} if mixed else set())
            if r.status_code >= 500:
                problems.append(f"{where}: {r.status_code} {r.text[:300]}")
            elif (route.params or route.id in REFERS) and r.status_code not in allowed:
                problems.append(f"{where}: {r.status_code} on tenant A's object: {r.text[:300]}")
            elif r.status_code == 409 and not mixed:
                problems.append(f"{where}: 409 tells B that A's object exists: {r.text[:300]}")
            leaked = _leaks(r.text + json.dumps(dict(r.headers)), req, world)
            if leaked:
                problems.append(f"{where}: {r.status_code} shows tenant A's {leaked}")
            if r.is_success and route.id in CLEANUP:
                assert CLEANUP[route.id](client, world, r).is_success
    assert not problems, "\n".join(problems)


def test_tenant_a_objects_are_intact(world: World) -> None:
    """After B's calls (run above, in this module's order), A still has every object: a refusal that acted
    anyway would show here."""
    i = world.ids
    with world.a.http() as c:
        assert c.get(f"/v1/sandboxes/{i['sandbox']}").status_code == 200
        assert c.get(f"/v1/volumes/{i['volume_name']}").status_code == 200
        assert c.get(f"/v1/credentials/{i['credential']}").status_code == 200
        assert c.get(f"/e2b/secrets/{i['e2b_secret_id']}").status_code == 200
        assert i["key_id"] in c.get("/v1/keys").text
        assert i["webhook_id"] in c.get("/v1/webhooks").text
        assert c.get(f"/v1/sandboxes/{i['sandbox']}/schedules/{i['schedule_id']}").status_code == 200
        assert {s["id"] for s in c.get(f"/v1/sandboxes/{i['sandbox']}/snapshots").json()["snapshots"]} >= {
            i["snapshot_a"], i["snapshot_b"]}


def test_middleware_entry_points_refuse_another_tenants_sandbox(stack: Any, world: World) -> None:
    """What no route lists: E2B's envd traffic routed by header (``EnvdRouting``) and guest ports by path
    (``PortsEdge``). B's key on A's sandbox opens neither."""
    sbx = world.ids["sandbox"]
    headers = {"authorization": f"Bearer {world.b.key}", "x-api-key": world.b.key}
    with httpx.Client(base_url=stack.api_url, headers=headers, timeout=30) as c:
        envd = c.post("/filesystem.Filesystem/Stat", json={"path": "/"},
                      headers={"e2b-sandbox-id": sbx, "e2b-sandbox-port": "49983"})
        assert envd.status_code in (401, 403, 404), envd.text
        for path in (f"/ports/8080-{sbx.replace('_', '-')}/", f"/ports/8080-{sbx.replace('_', '-')}/x?y=1"):
            r = c.get(path)
            assert r.status_code in (401, 403, 404), (path, r.status_code, r.text[:300])
            assert not _leaks(r.text, {"url": path, "sandbox": sbx}, world)  # its id B spelled with a dash
