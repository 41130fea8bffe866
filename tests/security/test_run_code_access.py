"""Tenant vs tenant at ``run_code`` (docs/code-interpreter.md): the SDK reaches a sandbox's code interpreter
through the port edge's path form with the caller's API key, so another tenant's key must not open it, and a
sandbox id that is not an id (traversal, encoded slashes, another path) must never become a request.
"""

from __future__ import annotations

import pytest
from access_helpers import new_tenant, template_and_sandbox

from podbay.errors import Forbidden, InvalidRequest, NotFound, PodbayError
from podbay.sdk import Client

pytestmark = pytest.mark.security


def test_another_tenants_key_does_not_run_code_in_a_sandbox(stack: object) -> None:
    a, b = new_tenant(stack, "ci-a"), new_tenant(stack, "ci-b")
    _, sbx = template_and_sandbox(stack, a, state="running")
    with Client(stack.api_url, b.key, timeout_s=30) as c:  # type: ignore[attr-defined]
        with pytest.raises((Forbidden, NotFound)) as err:
            c.run_code(sbx, "import os; os.environ")
        assert sbx not in str(err.value) or "does not open" in str(err.value)
        # The dashed spelling of the id names the same sandbox at the edge: refused the same way.
        with pytest.raises((Forbidden, NotFound, InvalidRequest)):
            c.run_code(sbx.replace("_", "-"), "1")
        for bad in (f"../v1/sandboxes/{sbx}", f"{sbx}/..", "%2e%2e", f"{sbx}%2Fx", f"{sbx}?x=1", ""):
            with pytest.raises(InvalidRequest):
                c.run_code(bad, "1")
    # A's own key passes the edge's check (the sandbox has no node here, so the edge answers it is not
    # running: 409, never 401/403).
    with Client(stack.api_url, a.key, timeout_s=30) as c:  # type: ignore[attr-defined]
        with pytest.raises(PodbayError) as own:
            c.run_code(sbx, "1")
        assert not isinstance(own.value, Forbidden | NotFound), own.value
