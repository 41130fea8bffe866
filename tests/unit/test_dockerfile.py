"""The Dockerfile subset parser (libs/podbay/dockerfile.py): each instruction, substitution, and the errors
that name the line and instruction."""

from __future__ import annotations

import pytest

from podbay.contracts.templates import CopyStep, RunStep, WorkdirStep, step_text
from podbay.dockerfile import DEFAULT_PATH, DockerfileError, parse_dockerfile

EXAMPLE = """\
# syntax=docker/dockerfile:1
ARG BASE=base
FROM podbay/${BASE}
ARG NODE=18
RUN apt-get update && \\
    apt-get install -y nodejs && useradd -m agent
COPY --chown=agent:agent app/ /srv/app
ADD vendor.tar.gz /opt/
ENV PORT=3000 NAME="my app"
ENV PATH=/srv/bin:$PATH
WORKDIR /srv/app
RUN ["node", "--version"]
USER agent
LABEL team=agents version=${NODE}
EXPOSE 3000 53/udp
CMD ["node", "server.js"]            # the start command
"""


def test_example_parses_into_steps_and_config() -> None:
    spec = parse_dockerfile(EXAMPLE, {"NODE": "20"})
    assert spec.base.kind == "template" and spec.base.ref == "base"
    kinds = [s.op for s in spec.steps]
    assert kinds == ["run", "copy", "copy", "workdir", "run"]
    run1, copy1, add1, wd, run2 = spec.steps
    assert isinstance(run1, RunStep) and run1.shell == "apt-get update && apt-get install -y nodejs && useradd -m agent"
    assert run1.env == {"NODE": "20"} and run1.user == "root" and run1.workdir == "/" and run1.line == 5
    assert isinstance(copy1, CopyStep) and copy1.sources == ["app"] and copy1.dest == "/srv/app"
    assert copy1.chown == "agent:agent" and not copy1.add
    assert isinstance(add1, CopyStep) and add1.add and add1.dest == "/opt/"
    assert isinstance(wd, WorkdirStep) and wd.path == "/srv/app"
    assert isinstance(run2, RunStep) and run2.argv == ["node", "--version"] and run2.shell is None
    assert run2.workdir == "/srv/app" and run2.env["PORT"] == "3000"
    cfg = spec.config
    assert cfg.env == {"PORT": "3000", "NAME": "my app", "PATH": "/srv/bin:" + DEFAULT_PATH}
    assert cfg.workdir == "/srv/app" and cfg.user == "agent"
    assert cfg.labels == {"team": "agents", "version": "20"}
    assert cfg.expose == ["3000", "53/udp"]
    assert cfg.start_cmd == ["node", "server.js"]


def test_arg_default_applies_without_a_build_arg_and_args_are_not_in_the_final_env() -> None:
    spec = parse_dockerfile("FROM base\nARG V=1\nRUN echo $V\n")
    assert isinstance(spec.steps[0], RunStep) and spec.steps[0].env == {"V": "1"}
    assert spec.config.env == {}


def test_env_legacy_form_and_relative_workdir_and_copy_dest() -> None:
    spec = parse_dockerfile("FROM podbay/base\nENV GREETING hello world\nWORKDIR /a\nWORKDIR b\nCOPY x.txt y/\n")
    assert spec.config.env == {"GREETING": "hello world"}
    assert spec.config.workdir == "/a/b"
    copy = spec.steps[-1]
    assert isinstance(copy, CopyStep) and copy.dest == "/a/b/y/"


def test_entrypoint_and_cmd_shell_forms_make_the_start_command() -> None:
    spec = parse_dockerfile('FROM base\nENTRYPOINT ["tini", "--"]\nCMD python3 -m http.server\n')
    assert spec.config.start_cmd == ["tini", "--", "/bin/sh", "-c", "python3 -m http.server"]


def test_oci_from_is_parsed() -> None:
    assert parse_dockerfile("FROM oci-archive:./img.tar\n").base.kind == "oci"


@pytest.mark.parametrize(("text", "line", "instruction", "fragment"), [
    ("FROM base\nHEALTHCHECK CMD true\n", 2, "HEALTHCHECK", "not supported"),
    ("FROM base\nFROBNICATE x\n", 2, "FROBNICATE", "unknown instruction"),
    ("RUN true\n", 1, "RUN", "must be FROM"),
    ("FROM base\nFROM other\n", 2, "FROM", "multi-stage"),
    ("FROM Not_A_Name\n", 1, "FROM", "not a podbay template name"),
    ("FROM ubuntu:22.04\n", 1, "FROM", "OCI images such as ubuntu:22.04 are not supported yet"),
    ("FROM base\nRUN [\"a\", 1]\n", 2, "RUN", "array of strings"),
    ("FROM base\nRUN [\"a\"\n", 2, "RUN", "JSON"),
    ("FROM base\nCOPY onlyone\n", 2, "COPY", "source and a destination"),
    ("FROM base\nCOPY ../secret /x\n", 2, "COPY", "outside the build context"),
    ("FROM base\nADD https://example.com/x /x\n", 2, "ADD", "remote sources"),
    ("FROM base\nCOPY --from=build /a /b\n", 2, "COPY", "--from is not supported"),
    ("FROM base\nCOPY a b /c\n", 2, "COPY", "must end with /"),
    ("FROM base\nENV =x\n", 2, "ENV", "not KEY=VALUE"),
    ("FROM base\nENV 1A=x\n", 2, "ENV", "not a valid variable name"),
    ("FROM base\nEXPOSE http\n", 2, "EXPOSE", "PORT"),
    ("FROM base\nUSER a b\n", 2, "USER", "not a user name"),
    ("FROM base\nRUN\n", 2, "RUN", "needs arguments"),
    ("", 0, "", "no FROM"),
])
def test_errors_name_the_line_and_instruction(text: str, line: int, instruction: str, fragment: str) -> None:
    with pytest.raises(DockerfileError) as info:
        parse_dockerfile(text)
    exc = info.value
    assert exc.http_status == 422 and exc.code == "invalid_dockerfile"
    assert exc.details == {"line": line, "instruction": instruction}
    assert fragment in exc.message
    if line:
        assert f"line {line}" in exc.message


def test_undeclared_build_arg_is_refused() -> None:
    with pytest.raises(DockerfileError, match="not declared"):
        parse_dockerfile("FROM base\nRUN true\n", {"NOPE": "1"})


def test_step_text_ignores_the_line_but_not_the_context() -> None:
    a = parse_dockerfile("FROM base\nRUN make\n").steps[0]
    b = parse_dockerfile("FROM base\n# a comment\n\nRUN make\n").steps[0]
    c = parse_dockerfile("FROM base\nENV X=1\nRUN make\n").steps[0]
    d = parse_dockerfile("FROM base\nUSER nobody\nRUN make\n").steps[0]
    assert step_text(a) == step_text(b)
    assert len({step_text(a), step_text(c), step_text(d)}) == 3
