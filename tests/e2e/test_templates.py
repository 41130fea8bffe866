"""Templates from Dockerfiles, with real VMs (services/nodeagent/build/, services/api/routes/templates.py).

One build whose steps use RUN, COPY (--chown=USER: the user's primary group), ARG, ENV, WORKDIR and USER,
and a sandbox that sees each effect; a rebuild changing only the last step reuses the earlier layers (its events say cached) while a
sandbox of the first version keeps it, and a tag (``e2e-web:v1``) keeps naming the first version for new creates
and keeps its build on the node when a later build reclaims the unreferenced second; a failed RUN registers nothing and leaves no half layer; bad input
is refused before any VM starts; a template in use is not removed; a start command (CMD) runs in every
sandbox from its first exec, and one that exits before it is ready fails the build; RUN steps reach the
network under the build's egress policy and nothing without one (skipped where the machine has no way to
a package index); a template built with other memory, vCPUs and disk gives sandboxes with them, and bad
values are refused; a node agent SIGKILLed mid-build fails the build and leaves no builder VM behind.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, new_sandbox, sh, until

from podbay.contracts.templates import BuildEvent
from podbay.sdk import Client, TemplateBuildFailed

pytestmark = pytest.mark.e2e

DOCKERFILE = """\
FROM podbay/base
ARG GREETING=hi
RUN useradd -m agent && mkdir -p /srv && echo "$GREETING from run" > /srv/run.txt
COPY app/ /srv/app/
COPY --chown=agent data.txt /home/agent/data.txt
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
        # Built as e2e-web:v1: the template's current build, tagged v1 (creates of e2e-web:v1 keep getting it).
        tpl, events = _build(c, "e2e-web:v1", DOCKERFILE.format(last="first"), ctx, build_args={"GREETING": "hello"})
        assert tpl.name == "e2e-web" and tpl.parent == "base"
        assert [(g.tag, g.digest) for g in tpl.tags] == [("v1", tpl.digest)]
        assert tpl.config is not None and tpl.config.user == "agent" and tpl.config.workdir == "/srv/app"
        assert _steps(events) == {1: False, 2: False, 3: False, 4: False, 5: False}
        assert "COPY --chown=agent data.txt /home/agent/data.txt" in [e.text for e in events if e.type == "step"]
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
                assert h.get(f"/v1/sandboxes/{sid2}").json()["template_digest"] == tpl2.digest
                assert sh(h, sid2, "cat /srv/run.txt") == "hello from run\n"
            # The tag still names the first version: a create of it gets that build (a cold restore).
            with new_sandbox(h, "e2e-web:v1") as sid3:
                assert sh(h, sid3, "cat /home/agent/last.txt") == "first\n"
                # Each sandbox names the build it runs, whatever the template's current one is now.
                got = {s: h.get(f"/v1/sandboxes/{s}").json() for s in (sid, sid3)}
                assert [(got[s]["template"], got[s]["template_digest"]) for s in (sid, sid3)] == [
                    ("e2e-web", tpl.digest), ("e2e-web", tpl.digest)], got
            r = h.post("/v1/sandboxes", json={"template": "e2e-web:v9"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "template_tag_not_found", r.text
            r = h.post("/v1/sandboxes", json={"template": "e2e-web:V1"})
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
            for bad in ("e2e-web:-v1", "e2e-web:" + "v" * 65):  # a tag outside [a-z0-9][a-z0-9._-]{0,63}
                r = h.post("/v1/templates", data={"name": bad, "dockerfile": "FROM podbay/base\n"})
                assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
                r = h.delete(f"/v1/templates/{bad}")
                assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
            r = h.delete("/v1/templates/e2e-web:v1")  # the first sandbox runs on the tagged build
            assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
            # The first sandbox keeps its version, and the node keeps that build while it is used.
            assert sh(h, sid, "cat /home/agent/last.txt") == "first\n"
            builds = {p.name for p in Path(stack.data_dir).glob("nodes/*/store/templates/e2e-web/*")}
            assert {tpl.digest, tpl2.digest} <= builds
            r = h.delete("/v1/templates/e2e-web")
            assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
        listed = {t["name"]: t for t in h.get("/v1/templates").json()["templates"]}
        assert listed["e2e-web"]["digest"] == tpl2.digest
        assert [(g["tag"], g["digest"]) for g in listed["e2e-web"]["tags"]] == [("v1", tpl.digest)]
        until("the sandboxes' deletion", lambda: all(
            h.get(f"/v1/sandboxes/{i}").json()["state"] == "deleted" for i in (sid, sid2, sid3)), 60)
        # A third version: its build reclaims the second (nothing references it any more), while the first,
        # which no sandbox uses now, stays because the tag names it.
        tpl3, _ = _build(c, "e2e-web", DOCKERFILE.format(last="third"), ctx, build_args={"GREETING": "hello"})
        builds = {p.name for p in Path(stack.data_dir).glob("nodes/*/store/templates/e2e-web/*")}
        assert tpl.digest in builds and tpl3.digest in builds and tpl2.digest not in builds, builds
        r = h.delete("/v1/templates/e2e-web:v1")
        assert r.status_code == 204, r.text
        r = h.post("/v1/sandboxes", json={"template": "e2e-web:v1"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "template_tag_not_found", r.text
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

        # A second build of a name while one runs.
        first = threading.Thread(target=lambda: _build(c, "e2e-slow", "FROM podbay/base\nRUN sleep 8\n", None))
        first.start()
        try:
            # Its row says running from the moment the API accepts it until it ends (a build directory in the
            # store is no sign: earlier builds' stay, so that check raced the build to its end).
            # Until the API has the build's row, the name is unknown: 404.
            until("the first build to run", lambda: any(
                b["state"] == "running" for b in h.get("/v1/templates/e2e-slow/builds").json().get("builds", [])),
                60, 0.1)
            refused(409, "conflict", "e2e-slow", "FROM podbay/base\nRUN true\n")
        finally:
            first.join(120)
        assert h.delete("/v1/templates/e2e-slow").status_code == 204


def test_resources_are_build_parameters_and_bad_ones_are_refused(stack: Any) -> None:
    """A template built with other memory, vCPUs and a larger disk than base's (one boot of base's disk with
    them, then its steps on that) gives sandboxes with that memory (guest MemTotal), those vCPUs and that
    filesystem size, and the steps' files; bad values are refused with 422 before anything starts."""
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        base = next(t for t in c.list_templates() if t.name == "base")
        assert (base.memory_mib, base.vcpus) == (256, 1)
        # A disk smaller than base's is refused by the node (which knows base's size, and says it).
        r = h.post("/v1/templates", data={"name": "e2e-bad-size", "dockerfile": "FROM podbay/base\n",
                                          "disk_mib": "512"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
        base_disk_mib = int(r.json()["error"]["details"]["from_disk_mib"])
        assert base_disk_mib > 512
        tpl, events = _build(c, "e2e-sized", "FROM podbay/base\nRUN echo sized > /etc/sized\n", None,
                             memory_mib=512, vcpus=2, disk_mib=base_disk_mib + 512)
        assert (tpl.memory_mib, tpl.vcpus, tpl.size_bytes) == (512, 2, (base_disk_mib + 512) << 20)
        logs = "".join(e.text or "" for e in events if e.type == "log")
        assert "booting base's disk with 512 MiB and 2 vCPUs" in logs, logs
        with new_sandbox(h, "e2e-sized") as sid:
            info = h.get(f"/v1/sandboxes/{sid}").json()
            assert (info["memory_mib"], info["vcpus"]) == (512, 2)
            mem_kib = int(sh(h, sid, "awk '/^MemTotal:/ {print $2}' /proc/meminfo"))
            assert 400 << 10 < mem_kib <= 512 << 10, mem_kib  # the kernel keeps some for itself
            assert sh(h, sid, "nproc") == "2\n"
            fs_kib = int(sh(h, sid, "df -k --output=size / | tail -1"))
            assert fs_kib > (base_disk_mib + 256) << 10, fs_kib  # base's is under base_disk_mib
            assert sh(h, sid, "cat /etc/sized") == "sized\n"

        def refused(status: int, code: str, **form: Any) -> None:
            r = h.post("/v1/templates", data={"name": "e2e-bad-size", "dockerfile": "FROM podbay/base\n",
                                             **{k: str(v) for k, v in form.items()}})
            assert r.status_code == status and r.json()["error"]["code"] == code, (form, r.text)

        refused(422, "validation_error", memory_mib=64)
        refused(422, "validation_error", memory_mib=1 << 20)
        refused(422, "validation_error", vcpus=0)
        refused(422, "validation_error", vcpus=65)
        refused(422, "validation_error", memory_mib="lots")
        refused(422, "validation_error", disk_mib=100)
        assert "e2e-bad-size" not in {t.name for t in c.list_templates()}
        assert h.delete("/v1/templates/e2e-sized").status_code == 204


def test_start_command_serves_from_the_first_exec_and_one_that_exits_fails(stack: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "www"
    ctx.mkdir()
    (ctx / "index.html").write_text("hello from the start command\n")
    dockerfile = ("FROM podbay/base\nCOPY index.html /srv/www/\nWORKDIR /srv/www\n"
                  'CMD ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"]\n')
    fetch = ("python3 -c \"import urllib.request; "
             "print(urllib.request.urlopen('http://127.0.0.1:8000/index.html').read().decode(), end='')\"")
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        tpl, events = _build(c, "e2e-srv", dockerfile, ctx, ready_port=8000)
        assert tpl.config is not None and tpl.config.start_cmd is not None and tpl.config.ready_port == 8000
        starts = [e for e in events if e.type == "step" and (e.text or "").startswith("START")]
        assert len(starts) == 1 and starts[0].cached is False and starts[0].step == 3
        with new_sandbox(h, "e2e-srv") as sid:
            assert sh(h, sid, fetch) == "hello from the start command\n"  # the sandbox's first exec
        assert h.delete("/v1/templates/e2e-srv").status_code == 204

        with pytest.raises(TemplateBuildFailed) as info:
            _build(c, "e2e-srv-bad", 'FROM podbay/base\nCMD ["sh", "-c", "echo dying; exit 7"]\n', None,
                   ready_port=8001)
        d = info.value.details
        assert d["exit_code"] == 7 and "dying" in d["output_tail"], d
        assert "e2e-srv-bad" not in {t["name"] for t in h.get("/v1/templates").json()["templates"]}


def test_run_steps_reach_the_network_under_the_builds_egress_policy(stack: Any) -> None:
    from test_egress_package_index import _hosts, _index_url, _package_page

    index_url = _index_url()
    page_url, page = _package_page(index_url)  # skips when this machine cannot reach the index
    port = urllib.parse.urlsplit(page_url).port or (443 if page_url.startswith("https:") else 80)
    allow = [{"domain": h, "ports": sorted({port, 443})} for h in sorted(_hosts(page_url, page))]
    code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=60).status)"
    run = "RUN " + json.dumps(["python3", "-c", code, page_url]) + "\n"
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        tpl, events = _build(c, "e2e-net", "FROM podbay/base\n" + run, None, egress={"allow": allow})
        assert any(e.type == "log" and "200" in (e.text or "") for e in events), events
        assert h.delete("/v1/templates/e2e-net").status_code == 204
        with pytest.raises(TemplateBuildFailed) as info:  # the same step without a policy: no egress
            _build(c, "e2e-net", "FROM podbay/base\nARG UNCACHED=1\n" + run, None)  # (an ARG: not cached)
        assert info.value.details["step"] == 1 and info.value.details["exit_code"] != 0


def test_node_agent_killed_mid_build_fails_it_and_leaves_no_builder(stack: Any) -> None:
    store = Path(stack.data_dir)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            with Client(stack.api_url, stack.api_key, timeout_s=600) as c:
                _build(c, "e2e-crash", "FROM podbay/base\nRUN sleep 120\n", None)
        except BaseException as exc:  # the stream breaks with the node agent
            errors.append(exc)

    def builder_pid() -> int | None:
        for pidfile in store.glob("nodes/*/store/builds/bld*/qemu.pid"):
            text = pidfile.read_text().strip()
            if text.isdigit():
                return int(text)
        return None

    first = threading.Thread(target=build)
    first.start()
    pid = until("the builder VM", builder_pid, 120, 0.2)
    stack.kill("nodeagent", signal.SIGKILL)
    stack.restart("nodeagent")
    first.join(120)
    assert errors and not first.is_alive()
    until("the builder VM to be killed", lambda: not Path(f"/proc/{pid}").exists(), 30, 0.2)
    assert not list(store.glob("nodes/*/store/builds/*")) and not list(store.glob("nodes/*/store/layers/.tmp-*"))
    # The restarted agent also removed the builds of removed templates that nothing uses (e2e-web, above).
    assert not list(store.glob("nodes/*/store/templates/e2e-web/*"))
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        assert "e2e-crash" not in {t["name"] for t in h.get("/v1/templates").json()["templates"]}
        [cut] = c.list_builds("e2e-crash")
        assert cut.state == "failed" and cut.error is not None and cut.error["code"] == "interrupted", cut
        tpl, _ = _build(c, "e2e-crash", "FROM podbay/base\nRUN true\n", None)  # not refused as still running
        assert tpl.name == "e2e-crash"
        assert [b.state for b in c.list_builds("e2e-crash")] == ["succeeded", "failed"]
        assert h.delete("/v1/templates/e2e-crash").status_code == 204


def test_api_killed_mid_build_ends_it_and_the_name_builds_again(stack: Any) -> None:
    """The API SIGKILLed while it relays a build: the node's stream is cut, so the node kills the builder VM
    and records the build failed (``interrupted``); the restarted API builds the name again (no 409)."""
    store = Path(stack.data_dir)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            with Client(stack.api_url, stack.api_key, timeout_s=600) as c:
                _build(c, "e2e-cut", "FROM podbay/base\nRUN sleep 120\n", None)
        except BaseException as exc:  # the stream breaks with the API
            errors.append(exc)

    def builder_pid() -> int | None:
        for pidfile in store.glob("nodes/*/store/builds/bld*/qemu.pid"):
            text = pidfile.read_text().strip()
            if text.isdigit():
                return int(text)
        return None

    first = threading.Thread(target=build)
    first.start()
    pid = until("the builder VM", builder_pid, 120, 0.2)
    stack.kill("api", signal.SIGKILL)
    stack.restart("api")
    first.join(120)
    assert errors and not first.is_alive()
    until("the builder VM to be killed", lambda: not Path(f"/proc/{pid}").exists(), 60, 0.2)
    with Client(stack.api_url, stack.api_key, timeout_s=600) as c, api_client(stack) as h:
        cut = until("the build to end", lambda: next((b for b in c.list_builds("e2e-cut") if b.state != "running"),
                                                     None), 60, 0.2)
        assert cut.state == "failed" and cut.error is not None and cut.error["code"] == "interrupted", cut
        tpl, _ = _build(c, "e2e-cut", "FROM podbay/base\nRUN true\n", None)  # not refused as still running
        assert tpl.name == "e2e-cut"
        assert [b.state for b in c.list_builds("e2e-cut")] == ["succeeded", "failed"]
        assert h.delete("/v1/templates/e2e-cut").status_code == 204
