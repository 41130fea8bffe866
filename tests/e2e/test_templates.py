"""Templates from Dockerfiles, with real VMs (services/nodeagent/build/, services/api/templates.py).

One build whose steps use RUN, COPY (--chown), ARG, ENV, WORKDIR and USER, and a sandbox that sees each
effect; a rebuild changing only the last step reuses the earlier layers (its events say cached) while a
sandbox of the first version keeps it; a failed RUN registers nothing and leaves no half layer; bad input
is refused before any VM starts; a template in use is not removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, new_sandbox, sh

from podbay.contracts.templates import BuildEvent
from podbay.sdk import Client, TemplateBuildFailed

pytestmark = pytest.mark.e2e

DOCKERFILE = """\
FROM podbay/base
ARG GREETING=hi
RUN useradd -m agent && mkdir -p /srv && echo "$GREETING from run" > /srv/run.txt
COPY app/ /srv/app/
COPY --chown=agent:agent data.txt /home/agent/data.txt
ENV APP_MODE=test
WORKDIR /srv/app
USER agent
RUN echo {last} > /home/agent/last.txt
"""


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "main.txt").write_text("main file\n")
    (ctx / "data.txt").write_text("agent data\n")
    return ctx


def _build(c: Client, name: str, dockerfile: str, ctx: Path | None, **kw: Any) -> tuple[Any, list[BuildEvent]]:
    events: list[BuildEvent] = []
    tpl = c.build_template(name, dockerfile, ctx, on_event=events.append, **kw)
    return tpl, events


def _steps(events: list[BuildEvent]) -> dict[int, bool]:
    """Disk step index -> cached, from the build's step events (step 0 is FROM)."""
    return {e.step: bool(e.cached) for e in events if e.type == "step" and e.step}


def _store_layers(stack: Any) -> list[Path]:
    return [p for p in Path(stack.data_dir).glob("nodes/*/store/layers/*")]


def test_dockerfile_build_each_effect_cached_rebuild_and_versions(stack: Any, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        tpl, events = _build(c, "e2e-web", DOCKERFILE.format(last="first"), ctx, build_args={"GREETING": "hello"})
        assert tpl.name == "e2e-web" and tpl.parent == "base"
        assert tpl.config is not None and tpl.config.user == "agent" and tpl.config.workdir == "/srv/app"
        assert _steps(events) == {1: False, 2: False, 3: False, 4: False, 5: False}
        assert any(e.type == "done" for e in events)
        with new_sandbox(h, "e2e-web") as sid:
            assert sh(h, sid, "cat /srv/run.txt") == "hello from run\n"
            assert sh(h, sid, "cat /srv/app/main.txt") == "main file\n"
            assert sh(h, sid, "stat -c %U:%G /home/agent/data.txt; cat /home/agent/data.txt") == \
                "agent:agent\nagent data\n"
            assert sh(h, sid, "echo $APP_MODE") == "test\n"
            assert sh(h, sid, "pwd") == "/srv/app\n"
            assert sh(h, sid, "id -un") == "agent\n"
            assert sh(h, sid, "cat /home/agent/last.txt") == "first\n"
            # A request's own cwd, user and env still win over the template's defaults.
            r = h.post(f"/v1/sandboxes/{sid}/exec", json={"shell": "id -un; pwd; echo $APP_MODE", "user": "root",
                                                         "cwd": "/", "env": {"APP_MODE": "mine"}})
            assert r.json()["stdout"] == "root\n/\nmine\n", r.text

            tpl2, events2 = _build(c, "e2e-web", DOCKERFILE.format(last="second"), ctx,
                                   build_args={"GREETING": "hello"})
            assert _steps(events2) == {1: True, 2: True, 3: True, 4: True, 5: False}
            assert tpl2.digest != tpl.digest
            with new_sandbox(h, "e2e-web") as sid2:
                assert sh(h, sid2, "cat /home/agent/last.txt") == "second\n"
                assert sh(h, sid2, "cat /srv/run.txt") == "hello from run\n"
            # The first sandbox keeps its version.
            assert sh(h, sid, "cat /home/agent/last.txt") == "first\n"
            r = h.delete("/v1/templates/e2e-web")
            assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
        listed = {t["name"]: t for t in h.get("/v1/templates").json()["templates"]}
        assert listed["e2e-web"]["digest"] == tpl2.digest
        r = h.delete("/v1/templates/e2e-web")
        assert r.status_code == 204, r.text
        assert "e2e-web" not in {t["name"] for t in h.get("/v1/templates").json()["templates"]}
        r = h.post("/v1/sandboxes", json={"template": "e2e-web"})
        assert r.status_code == 404, r.text


def test_failed_step_registers_nothing_and_bad_input_is_refused(stack: Any, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        with pytest.raises(TemplateBuildFailed) as info:
            _build(c, "e2e-broken", "FROM podbay/base\nRUN echo before > /x\nRUN echo boom; exit 3\n", ctx)
        d = info.value.details
        assert d["step"] == 2 and d["exit_code"] == 3 and "boom" in d["output_tail"]
        assert "e2e-broken" not in {t["name"] for t in h.get("/v1/templates").json()["templates"]}
        assert not [p for p in _store_layers(stack) if p.name.startswith(".tmp-")]
        assert not list(Path(stack.data_dir).glob("nodes/*/store/templates/e2e-broken"))

        def refused(status: int, code: str, name: str, dockerfile: str, files: dict[str, Any] | None = None) -> None:
            r = h.post("/v1/templates", data={"name": name, "dockerfile": dockerfile}, files=files or {})
            assert r.status_code == status and r.json()["error"]["code"] == code, r.text

        refused(422, "validation_error", "Bad_Name", "FROM podbay/base\n")
        refused(404, "not_found", "e2e-x", "FROM podbay/no-such-template\n")
        refused(422, "invalid_dockerfile", "e2e-x", "FROM podbay/base\nHEALTHCHECK CMD true\n")
        refused(400, "missing_copy_source", "e2e-x", "FROM podbay/base\nCOPY nothere /x\n")
        refused(409, "conflict", "base", "FROM podbay/base\n")
