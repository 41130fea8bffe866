"""E2B's template build body -> podbay BuildSpec (podbay.e2b_build)."""

from __future__ import annotations

import pytest

from podbay.contracts.templates import CopyStep, ImageConfig, RunStep
from podbay.e2b_build import E2bBuildError, E2bBuildStart, files_dir, render, translate

SHELL = ["/bin/bash", "-l", "-c"]


def body(**kw: object) -> E2bBuildStart:
    return E2bBuildStart.model_validate({"fromImage": "e2bdev/base", "force": False, **kw})


def test_sdk_default_base_is_podbay_base_and_steps_run_as_user_in_home() -> None:
    t = translate(body(steps=[{"type": "RUN", "args": ["echo hi"], "force": False}]))
    assert t.spec.base.kind == "template" and t.spec.base.ref == "base"
    (step,) = t.spec.steps
    assert isinstance(step, RunStep)
    assert step.argv == [*SHELL, "echo hi"] and step.user == "user" and step.workdir == "/home/user"
    assert t.origins == [1] and t.files == [] and not t.from_image
    assert t.spec.config.user == "user" and t.spec.config.workdir is None and t.spec.config.start_cmd is None


def test_from_template_and_podbay_images() -> None:
    assert translate(body(fromImage=None, fromTemplate="base")).spec.base.ref == "base"
    assert translate(body(fromImage=None, fromTemplate="web:default")).spec.base.ref == "web"
    t = translate(body(fromImage="podbay/web"))
    assert t.spec.base.ref == "web" and t.from_image


@pytest.mark.parametrize("image", ["ubuntu:22.04", "docker.io/library/python:3", "oci-archive:./x.tar"])
def test_registry_images_are_refused(image: str) -> None:
    with pytest.raises(E2bBuildError, match="no image registry") as exc:
        translate(body(fromImage=image))
    assert exc.value.http_status == 400 and exc.value.details["step"] == "base"


def test_registry_credentials_are_refused() -> None:
    with pytest.raises(E2bBuildError, match="fromImageRegistry"):
        translate(body(fromImage="base", fromImageRegistry={"type": "registry", "username": "u", "password": "p"}))


def test_run_user_env_workdir_and_copy_follow_e2b_semantics() -> None:
    t = translate(body(steps=[
        {"type": "ENV", "args": ["GREETING", "hello", "PATH", "/opt/bin:$PATH"]},
        {"type": "WORKDIR", "args": ["/srv/app"]},
        {"type": "RUN", "args": ["echo $GREETING > greeting.txt"]},
        {"type": "COPY", "args": ["data/hello.txt", "notes/", "", ""], "filesHash": "a" * 64},
        {"type": "RUN", "args": ["apt-get update", "root"]},
        {"type": "USER", "args": ["agent"]},
        {"type": "RUN", "args": ["whoami"]},
    ]))
    steps = t.spec.steps
    assert t.origins == [2, 3, 4, 5, 6, 7]
    mkdir, greet, copy, apt, useradd, whoami = steps
    assert isinstance(mkdir, RunStep) and mkdir.user == "root" and "mkdir -p" in mkdir.argv[-1]  # type: ignore[index]
    assert "chown -R user:" in mkdir.argv[-1]  # type: ignore[index]
    assert isinstance(greet, RunStep) and greet.workdir == "/srv/app" and greet.user == "user"
    assert greet.env["GREETING"] == "hello"
    assert greet.env["PATH"].startswith("/opt/bin:/usr/local/sbin:")
    assert isinstance(copy, CopyStep)
    assert copy.sources == [files_dir("a" * 64) + "/data/hello.txt"] and copy.dest == "/srv/app/notes/"
    assert copy.chown == "user"
    assert isinstance(apt, RunStep) and apt.user == "root"
    assert isinstance(useradd, RunStep) and "useradd --create-home" in useradd.argv[-1]  # type: ignore[index]
    assert isinstance(whoami, RunStep) and whoami.user == "agent" and whoami.workdir == "/srv/app"
    assert t.files == ["a" * 64]
    cfg = t.spec.config
    assert cfg.env["GREETING"] == "hello" and cfg.workdir == "/srv/app" and cfg.user == "agent"


def test_copy_glob_copies_its_directory_part_and_mode_chmods_what_was_copied() -> None:
    t = translate(body(steps=[{"type": "COPY", "args": ["app/**/*.py", "/srv/", "root", "0755"],
                               "filesHash": "h1"}]),
                  members={"h1": {"app", "app/x.py", "app/pkg", "app/pkg/y.py"}})
    copy, chmod = t.spec.steps
    assert isinstance(copy, CopyStep) and copy.sources == ["e2b-files/h1/app"] and copy.chown == "root"
    assert isinstance(chmod, RunStep) and chmod.user == "root"
    assert chmod.argv[-1] == "chmod 0755 -- /srv/pkg /srv/pkg/y.py /srv/x.py"  # type: ignore[index]
    single = translate(body(steps=[{"type": "COPY", "args": ["run.sh", "/usr/local/bin/", "", "0700"],
                                    "filesHash": "h2"}]), members={"h2": {"run.sh"}})
    assert single.spec.steps[1].argv[-1] == "chmod 0700 -- /usr/local/bin/run.sh"  # type: ignore[union-attr]
    assert t.origins == [1, 1]


def test_start_and_ready_commands() -> None:
    t = translate(body(startCmd="python3 -m http.server 8000", readyCmd="ss -tuln | grep :8000"))
    assert t.spec.config.start_cmd == [*SHELL, "python3 -m http.server 8000"]
    assert t.spec.config.ready_cmd == "ss -tuln | grep :8000"
    only_ready = translate(body(readyCmd="[ -f /etc/hostname ]"))
    assert only_ready.spec.config.ready_cmd is None and only_ready.spec.config.start_cmd is None
    (check,) = only_ready.spec.steps
    assert isinstance(check, RunStep) and check.argv[-1] == "[ -f /etc/hostname ]"  # type: ignore[index]
    assert only_ready.origins == [0]


def test_parent_config_sets_the_starting_user_workdir_and_env() -> None:
    parent = ImageConfig(env={"A": "1"}, workdir="/work", user="agent")
    (step,) = translate(body(fromImage=None, fromTemplate="web", steps=[{"type": "RUN", "args": ["true"]}]),
                        parent=parent).spec.steps
    assert isinstance(step, RunStep) and step.user == "agent" and step.workdir == "/work" and step.env == {"A": "1"}


@pytest.mark.parametrize(("steps", "match"), [
    ([{"type": "RUN", "args": []}], "step 1: RUN needs a command"),
    ([{"type": "COPY", "args": ["a", "/b"]}], "step 1: COPY needs a filesHash"),
    ([{"type": "RUN", "args": ["true"]}, {"type": "COPY", "args": ["../x", "/b"], "filesHash": "h"}],
     "step 2: COPY source '../x'"),
    ([{"type": "ENV", "args": ["ONLY_KEY"]}], "ENV needs KEY, VALUE pairs"),
    ([{"type": "COPY", "args": ["a", "/b", "", "rwx"], "filesHash": "h"}], "not octal"),
    ([{"type": "HEALTHCHECK", "args": ["x"]}], "not a step podbay builds"),
])
def test_bad_steps_name_the_step(steps: list[dict[str, object]], match: str) -> None:
    with pytest.raises(E2bBuildError, match=match) as exc:
        translate(body(steps=steps))
    if match.startswith("step"):
        assert exc.value.details["step"] == match.split(":")[0].split()[-1]


def test_render_lists_base_and_steps() -> None:
    text = render(body(steps=[{"type": "RUN", "args": ["echo hi"]}], startCmd="sleep infinity"))
    assert text.splitlines()[1:] == ["FROM e2bdev/base", 'RUN ["echo hi"]', 'START "sleep infinity"']


def _sdk_body(template: object) -> E2bBuildStart:
    """The build body E2B's own SDK sends for ``template`` (its serializer, so the wire fields are exact)."""
    tb = template._template  # type: ignore[attr-defined]
    return E2bBuildStart.model_validate(tb._serialize(tb._instructions_with_hashes()))


def test_skip_cache_rebuilds_from_the_forced_step_or_everything() -> None:
    e2b = pytest.importorskip("e2b")
    plain = _sdk_body(e2b.Template().from_template("base").run_cmd("echo a").run_cmd("echo b"))
    assert translate(plain).spec.no_cache_from is None
    # skip_cache() before a step: that step and every later one (the SDK sets force on each of them).
    t = translate(_sdk_body(e2b.Template().from_template("base").run_cmd("echo a").skip_cache().run_cmd("echo b")
                            .run_cmd("echo c")))
    assert t.spec.no_cache_from == 1 and len(t.spec.steps) == 3
    # skip_cache() before the base, or Template.build(skip_cache=True) (the body's own force): every step.
    everything = _sdk_body(e2b.Template().skip_cache().from_template("base").run_cmd("echo a"))
    assert everything.force and translate(everything).spec.no_cache_from == 0
    assert translate(body(force=True, steps=[{"type": "RUN", "args": ["x"]}])).spec.no_cache_from == 0
    # A forced step that makes no podbay step (ENV) forces what follows it: here only the start snapshot.
    env_last = _sdk_body(e2b.Template().from_template("base").run_cmd("echo a").skip_cache().set_envs({"A": "1"}))
    t = translate(env_last)
    assert t.spec.no_cache_from == len(t.spec.steps) == 1
