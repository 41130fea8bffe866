"""E2B's ``Template`` builder, unmodified, builds a podbay template that ``Sandbox.create`` starts from
(services/api/e2b/templates.py, podbay.e2b_build): one build from base with set_envs, set_workdir, run_cmd and
copy, with ``memory_mb`` (the template's memory: its sandbox's guest has it), followed through the SDK's
status polling, and one sandbox of it that sees each effect; the same build with ``skip_cache`` runs every
step again (no step says CACHED). A registry image, and a memory size E2B
refuses, are refused before anything runs. The template's tags are read, assigned and removed through the SDK,
and the template listed, read and deleted through the API client it ships (services/api/e2b/template_admin.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def e2b_env(stack: Any) -> Iterator[dict[str, str]]:
    """The E2B_* variables that point the SDK at the stack (what ``podbay env --e2b`` prints)."""
    env = {"E2B_API_URL": f"{stack.api_url}/e2b", "E2B_SANDBOX_URL": stack.api_url, "E2B_API_KEY": stack.api_key}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    yield env
    mp.undo()


def test_template_build_then_sandbox_sees_each_step(e2b_env: dict[str, str], tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "data").mkdir(parents=True)
    (ctx / "data" / "hello.txt").write_text("hello from copy\n")
    template = (
        e2b.Template(file_context_path=str(ctx))
        .from_template("base")
        .set_envs({"GREETING": "hi-e2b"})
        .set_workdir("/srv/app")
        .run_cmd("echo $GREETING > greeting.txt && whoami > who.txt")
        .copy("data/hello.txt", "/srv/app/copied.txt")
    )
    logs: list[Any] = []
    info = e2b.Template.build(template, "e2b-built", memory_mb=512, on_build_logs=logs.append)
    assert info.template_id == "e2b-built" and info.name == "e2b-built"
    messages = [str(entry.message) for entry in logs]
    assert any("Uploaded 'data/hello.txt'" in m for m in messages)
    assert any("Template ready" in m for m in messages)
    status = e2b.Template.get_build_status(info)
    assert status.status.value == "ready"
    assert e2b.Template.exists("e2b-built") and not e2b.Template.exists("no-such-template")

    sb = e2b.Sandbox.create(template=info.template_id, timeout=300)
    try:
        assert sb.files.read("/srv/app/greeting.txt") == "hi-e2b\n"  # set_envs and set_workdir, at build time
        assert sb.files.read("/srv/app/who.txt") == "user\n"  # steps run as E2B's default user
        assert sb.files.read("/srv/app/copied.txt") == "hello from copy\n"
        owners = sb.commands.run("stat -c %U /srv/app /srv/app/copied.txt")
        assert owners.stdout.split() == ["user", "user"]
        # Commands start in the template's workdir, as its user, with its ENV.
        assert sb.commands.run("pwd; whoami; echo $GREETING").stdout.splitlines() == ["/srv/app", "user", "hi-e2b"]
        mem_kib = int(sb.commands.run("awk '/^MemTotal:/ {print $2}' /proc/meminfo").stdout)
        assert 400 << 10 < mem_kib <= 512 << 10, mem_kib  # memory_mb=512 (base has 256); the kernel keeps some
    finally:
        sb.kill()

    # skip_cache: the same template again runs every step instead of reusing the layers just made.
    again: list[Any] = []
    e2b.Template.build(template, "e2b-built", memory_mb=512, skip_cache=True, on_build_logs=again.append)
    steps = [str(e.message) for e in again if re.match(r"(CACHED )?\[\d+/\d+\]", str(e.message))]
    assert steps and not any(m.startswith("CACHED") for m in steps), steps

    with pytest.raises(e2b.BuildException, match="no image registry"):
        e2b.Template.build(e2b.Template().from_image("ubuntu:22.04").run_cmd("true"), "e2b-refused")
    with pytest.raises(Exception) as odd:  # E2B's API refuses an odd number of MiB with 400, as podbay's does
        e2b.Template.build(e2b.Template().from_template("base").run_cmd("true"), "e2b-refused", memory_mb=513)
    assert "memory must be an even number of MiB" in str(odd.value)

    # Template management through the API client the SDK ships (what E2B's CLI calls): list, get, delete.
    from e2b.api.client.api.templates import (
        delete_templates_template_id,
        get_templates,
        get_templates_template_id,
        get_v2_templates,
    )
    from e2b.connection_config import ConnectionConfig
    from e2b.api.client_sync import get_api_client

    client = get_api_client(ConnectionConfig())
    listed = {t.template_id: t for t in get_templates.sync(client=client)}
    assert {"base", "e2b-built"} <= set(listed), listed
    built = listed["e2b-built"]
    assert built.build_status.value == "ready" and built.names == ["e2b-built"] and not built.is_default
    assert (built.memory_mb, built.cpu_count) == (512, 1)
    assert built.spawn_count >= 1 and built.last_spawned_at is not None and listed["base"].is_default
    assert len(get_v2_templates.sync(client=client, limit=1)) == 1
    got = get_templates_template_id.sync("e2b-built", client=client)
    assert got.template_id == "e2b-built" and got.build_id == built.build_id
    assert str(got.builds[0].build_id) == got.build_id and got.builds[0].status.value == "ready"
    # Tags: one version per name in podbay, so its tag is E2B's default; other tags are refused, not ignored.
    [tag] = e2b.Template.get_tags("e2b-built")
    assert tag.tag == "default" and str(tag.build_id) == got.build_id
    assert e2b.Template.assign_tags("e2b-built:default", "latest").tags == ["latest"]
    with pytest.raises(e2b.TemplateException, match="one version per template name"):
        e2b.Template.assign_tags("e2b-built", ["v2"])
    with pytest.raises(e2b.TemplateException, match="cannot be removed"):
        e2b.Template.remove_tags("e2b-built", "default")
    with pytest.raises(e2b.TemplateException, match="^404: .*no tag 'v2'"):
        e2b.Template.remove_tags("e2b-built", "v2")
    refused = delete_templates_template_id.sync_detailed("base", client=client)
    assert refused.status_code == 409 and b'"code":409' in refused.content
    assert delete_templates_template_id.sync_detailed("e2b-built", client=client).status_code == 204
    assert not e2b.Template.exists("e2b-built")
    assert "e2b-built" not in [t.template_id for t in get_templates.sync(client=client)]
    assert delete_templates_template_id.sync_detailed("e2b-built", client=client).status_code == 404
    assert get_templates_template_id.sync_detailed("e2b-built", client=client).status_code == 404
