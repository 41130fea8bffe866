"""Parse the Dockerfile subset podbay builds templates from into a :class:`~podbay.contracts.templates.BuildSpec`.

Pure: no I/O. Supported: ``FROM`` (one stage; ``AS name`` ignored), ``RUN`` (shell and JSON exec form),
``COPY``/``ADD`` from the context (``--chown=USER[:GROUP]``; ADD unpacks local tar archives, URLs are
refused), ``ENV`` (``k=v ...`` and the legacy ``k v``), ``ARG`` (with defaults, overridden by build args;
before ``FROM`` too), ``WORKDIR``, ``USER``, ``LABEL``, ``CMD``/``ENTRYPOINT`` (together the start command),
``EXPOSE`` (recorded). ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` are expanded in every
instruction but RUN, CMD and ENTRYPOINT (their shell does it), as Docker does. Lines end with ``\\`` to
continue; ``#`` starts a comment at the start of a line (parser directives are comments here).

Anything else, or a malformed instruction, raises :class:`DockerfileError` (``code`` ``invalid_dockerfile``,
HTTP 422) whose message and details name the line and the instruction.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field

from podbay.contracts.templates import (
    TEMPLATE_NAME_RE,
    BuildSpec,
    CopyStep,
    FromRef,
    ImageConfig,
    RunStep,
    WorkdirStep,
)
from podbay.errors import Unprocessable

__all__ = ["DockerfileError", "parse_dockerfile", "parse_from", "SUPPORTED", "DEFAULT_PATH"]

SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "LABEL", "CMD", "ENTRYPOINT", "EXPOSE")
#: Known but not built (named in the error so the user knows it is a choice, not a typo).
_UNSUPPORTED = ("HEALTHCHECK", "VOLUME", "STOPSIGNAL", "SHELL", "ONBUILD", "MAINTAINER")
#: The PATH a RUN sees when no ENV sets it (guestd's default), so ``ENV PATH=/x:$PATH`` expands as expected.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_OCI_PREFIXES = ("oci:", "oci-archive:", "docker-archive:", "docker://")
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:[-+])?(?P<word>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class DockerfileError(Unprocessable):
    """A Dockerfile line podbay cannot build; ``details``: ``line`` (1-based), ``instruction``."""

    code = "invalid_dockerfile"

    def __init__(self, line: int, instruction: str, message: str) -> None:
        where = f"line {line}" + (f" ({instruction})" if instruction else "")
        super().__init__(f"Dockerfile {where}: {message}", details={"line": line, "instruction": instruction})
        self.line = line
        self.instruction = instruction


@dataclass
class _State:
    build_args: dict[str, str]
    args: dict[str, str] = field(default_factory=dict)  # ARGs declared in the stage, with values
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    workdir_set: bool = False
    user: str = "root"
    user_set: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    expose: list[str] = field(default_factory=list)
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None

    def vars(self) -> dict[str, str]:
        """What ``$VAR`` sees: ARGs, then ENV over them (Docker: ENV wins)."""
        return {"PATH": DEFAULT_PATH, **self.args, **self.env}


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, joined text) of each instruction: comments and blank lines dropped, ``\\``
    continuations joined (comment lines inside a continuation are skipped, as Docker does)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = no
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        out.append((start, " ".join(p for p in (b.strip() for b in buf) if p)))
        buf = []
    if buf:
        out.append((start, " ".join(p for p in (b.strip() for b in buf) if p)))
    return out


def _expand(value: str, env: dict[str, str], line: int, instruction: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        val = env.get(name)
        op = m.group("op")
        if op == ":-":
            return val if val else m.group("word")
        if op == ":+":
            return m.group("word") if val else ""
        if m.group("braced") and m.group("word"):
            raise DockerfileError(line, instruction, f"unsupported substitution {m.group(0)!r}")
        return val or ""

    return _VAR.sub(sub, value)


def _json_form(args: str, line: int, instruction: str) -> list[str] | None:
    """The exec form's argv when ``args`` is a JSON array (a trailing ``# comment`` allowed), else None."""
    s = args.strip()
    if not s.startswith("["):
        return None
    end = s.rfind("]")
    rest = s[end + 1:].strip() if end >= 0 else ""
    if end < 0 or (rest and not rest.startswith("#")):
        raise DockerfileError(line, instruction, "the exec form must be one JSON array of strings")
    try:
        argv = json.loads(s[:end + 1])
    except json.JSONDecodeError as exc:
        raise DockerfileError(line, instruction, f"the exec form is not valid JSON: {exc.msg}") from exc
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise DockerfileError(line, instruction, "the exec form must be a non-empty JSON array of strings")
    return argv


def _split(args: str, line: int, instruction: str) -> list[str]:
    try:
        return shlex.split(args, comments=False, posix=True)
    except ValueError as exc:
        raise DockerfileError(line, instruction, f"cannot split arguments: {exc}") from exc


def _flags(words: list[str], allowed: tuple[str, ...], line: int, instruction: str) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        if name not in allowed:
            raise DockerfileError(line, instruction, f"the flag --{name} is not supported"
                                  + (f" (supported: {', '.join('--' + a for a in allowed)})" if allowed else ""))
        if not value:
            raise DockerfileError(line, instruction, f"--{name} needs a value (--{name}=...)")
        flags[name] = value
    return flags, words


def _pairs(args: str, line: int, instruction: str, st: _State, *, legacy: bool) -> dict[str, str]:
    """``k=v k2="v 2"`` (or ``k v`` when ``legacy`` and the first word has no ``=``), values expanded."""
    words = _split(args, line, instruction)
    if not words:
        raise DockerfileError(line, instruction, "needs at least one KEY=VALUE")
    if legacy and "=" not in words[0]:
        key, _, value = args.strip().partition(" ")
        value = value.strip()
        if not value:
            raise DockerfileError(line, instruction, f"{key} has no value (KEY=VALUE or KEY VALUE)")
        words = [f"{key}={' '.join(_split(value, line, instruction))}"]
    out: dict[str, str] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or not key:
            raise DockerfileError(line, instruction, f"{w!r} is not KEY=VALUE")
        if instruction == "ENV" and not _ENV_KEY.match(key):
            raise DockerfileError(line, instruction, f"{key!r} is not a valid variable name")
        out[key] = _expand(value, {**st.vars(), **out}, line, instruction)
    return out


def parse_from(ref: str, line: int = 1) -> FromRef:
    """``FROM``'s argument as a :class:`FromRef`; raises :class:`DockerfileError` for a malformed name."""
    if ref.startswith(_OCI_PREFIXES):
        return FromRef(kind="oci", ref=ref)
    name = ref.removeprefix("podbay/")
    if name.endswith(":latest"):
        name = name[: -len(":latest")]
    if not re.match(TEMPLATE_NAME_RE, name):
        raise DockerfileError(line, "FROM", f"{ref!r} is not a podbay template name (podbay/NAME or NAME, of "
                              "[a-z0-9-]); OCI images such as ubuntu:22.04 are not supported yet: build FROM "
                              "podbay/base or another podbay template")
    return FromRef(kind="template", ref=name)


def _context_path(src: str, line: int, instruction: str) -> str:
    if re.match(r"^[a-z]+://", src):
        raise DockerfileError(line, instruction, f"{src!r}: remote sources are not supported; put the file "
                              "in the build context")
    norm = posixpath.normpath("/" + src).lstrip("/") or "."
    if posixpath.normpath(src).startswith("..") or src.startswith("/.."):
        raise DockerfileError(line, instruction, f"{src!r} points outside the build context")
    return norm


def _dest(path: str, st: _State) -> str:
    keep_slash = path.endswith("/")
    full = posixpath.normpath(posixpath.join(st.workdir, path))
    return full + "/" if keep_slash and full != "/" else full


def parse_dockerfile(text: str, build_args: dict[str, str] | None = None) -> BuildSpec:
    """Parse ``text`` with ``build_args`` (``--build-arg``) into a :class:`BuildSpec`.

    Raises :class:`DockerfileError` naming the line and instruction for anything outside the subset, for a
    malformed line, for a missing or second ``FROM``, and for a build arg the file does not declare.
    """
    st = _State(build_args=dict(build_args or {}))
    base: FromRef | None = None
    steps: list[RunStep | CopyStep | WorkdirStep] = []
    declared: set[str] = set()
    for line, body in _logical_lines(text):
        word, _, args = body.partition(" ")
        instr = word.upper()
        args = args.strip()
        if instr in _UNSUPPORTED:
            raise DockerfileError(line, instr, f"{instr} is not supported (supported: {', '.join(SUPPORTED)})")
        if instr not in SUPPORTED:
            raise DockerfileError(line, word, f"unknown instruction {word!r} (supported: {', '.join(SUPPORTED)})")
        if instr == "ARG":
            words = _split(args, line, instr)
            if len(words) != 1:
                raise DockerfileError(line, instr, "needs one NAME or NAME=DEFAULT")
            key, eq, default = words[0].partition("=")
            if not _ENV_KEY.match(key):
                raise DockerfileError(line, instr, f"{key!r} is not a valid variable name")
            declared.add(key)
            value = st.build_args.get(key, _expand(default, st.vars(), line, instr) if eq else None)
            if value is not None:
                st.args[key] = value
            continue
        if instr == "FROM":
            if base is not None:
                raise DockerfileError(line, instr, "multi-stage builds (a second FROM) are not supported")
            words = _split(args.split(" #", 1)[0], line, instr)
            if len(words) == 3 and words[1].upper() == "AS":
                words = words[:1]
            if len(words) != 1:
                raise DockerfileError(line, instr, "needs one image or template (FROM NAME [AS STAGE])")
            base = parse_from(_expand(words[0], st.vars(), line, instr), line)
            st.args = {}  # ARGs before FROM are only for FROM (Docker): redeclare them to use them after
            continue
        if base is None:
            raise DockerfileError(line, instr, "the first instruction must be FROM (or ARG)")
        if not args:
            raise DockerfileError(line, instr, f"{instr} needs arguments")
        if instr == "RUN":
            argv = _json_form(args, line, instr)
            env = {**st.args, **st.env}
            steps.append(RunStep(argv=argv, shell=None if argv else args, env=env, workdir=st.workdir,
                                 user=st.user, line=line))
        elif instr in ("COPY", "ADD"):
            exec_form = _json_form(args, line, instr)
            words = exec_form if exec_form is not None else _split(args, line, instr)
            flags, words = _flags(words, ("chown",), line, instr)
            words = [_expand(w, st.vars(), line, instr) for w in words]
            if len(words) < 2:
                raise DockerfileError(line, instr, "needs at least one source and a destination")
            srcs = [_context_path(s, line, instr) for s in words[:-1]]
            dest = _dest(words[-1], st)
            if len(srcs) > 1 and not dest.endswith("/"):
                raise DockerfileError(line, instr, "with several sources the destination must end with /")
            chown = _expand(flags["chown"], st.vars(), line, instr) if "chown" in flags else None
            if chown is not None and not re.match(r"^[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?$", chown):
                raise DockerfileError(line, instr, f"--chown={chown!r} is not USER[:GROUP]")
            steps.append(CopyStep(sources=srcs, dest=dest, chown=chown, add=instr == "ADD", line=line))
        elif instr == "ENV":
            st.env.update(_pairs(args, line, instr, st, legacy=True))
        elif instr == "LABEL":
            st.labels.update(_pairs(args, line, instr, st, legacy=False))
        elif instr == "WORKDIR":
            path = _expand(args, st.vars(), line, instr)
            st.workdir = posixpath.normpath(posixpath.join(st.workdir, path))
            st.workdir_set = True
            steps.append(WorkdirStep(path=st.workdir, line=line))
        elif instr == "USER":
            user = _expand(args, st.vars(), line, instr)
            if not re.match(r"^[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?$", user):
                raise DockerfileError(line, instr, f"{user!r} is not a user name or uid")
            st.user = user.split(":", 1)[0]  # guestd runs as the user's own groups
            st.user_set = True
        elif instr == "EXPOSE":
            for port in _split(_expand(args, st.vars(), line, instr), line, instr):
                if not re.match(r"^\d{1,5}(/(tcp|udp))?$", port) or not 0 < int(port.split("/")[0]) < 65536:
                    raise DockerfileError(line, instr, f"{port!r} is not PORT[/tcp|/udp]")
                st.expose.append(port)
        else:  # CMD, ENTRYPOINT
            argv = _json_form(args, line, instr)
            cmd = argv if argv is not None else ["/bin/sh", "-c", args]
            if instr == "CMD":
                st.cmd = cmd
            else:
                st.entrypoint = cmd
    if base is None:
        raise DockerfileError(0, "", "no FROM instruction")
    unknown = sorted(set(st.build_args) - declared)
    if unknown:
        raise DockerfileError(0, "ARG", f"build args {', '.join(unknown)} are not declared by an ARG")
    start = (st.entrypoint or []) + (st.cmd or []) if (st.entrypoint or st.cmd) else None
    config = ImageConfig(env=st.env, workdir=st.workdir if st.workdir_set else None,
                         user=st.user if st.user_set else None, start_cmd=start, expose=st.expose,
                         labels=st.labels)
    return BuildSpec(base=base, steps=steps, config=config)
