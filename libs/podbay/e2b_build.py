"""E2B's template build (the SDK's ``Template()`` builder) as a podbay :class:`~podbay.contracts.templates.BuildSpec`.

Pure: no I/O. The API (``services/api/e2b/templates.py``) receives E2B's ``TemplateBuildStartV2`` body
(:class:`E2bBuildStart`: ``fromImage``/``fromTemplate``, ``steps`` of ``{type, args, filesHash, force}``,
``startCmd``, ``readyCmd``) and :func:`translate` turns it into the spec podbay's builder runs, with E2B's
semantics where they differ from a Dockerfile's:

- Steps run as E2B's default user ``user`` (which podbay's base has), or the FROM template's user, until a
  ``USER`` step; a ``RUN`` may name its own user (``args[1]``). A step's working directory is the last
  ``WORKDIR``, else the user's home. Commands run as ``/bin/bash -l -c CMD``, as E2B's envd runs them.
- ``COPY [src, dest, owner, mode]`` copies from the step's uploaded archive, which the API unpacks under
  :func:`files_dir` ``(filesHash)`` in the build context. ``src`` may be a glob: its directory part (before
  the first segment with ``*?[{``) is copied, as E2B does (the archive holds only the matching files). The
  owner is ``owner`` or the current user; ``mode`` (octal text) is applied to the copied files and
  directories by a following ``RUN`` as root. A relative ``dest`` is taken from the working directory.
- ``ENV [k1, v1, k2, v2, ...]``: ``$VAR``/``${VAR}`` in values are expanded against the variables set so far;
  they are in every later step's environment and in the template's config (the defaults of podbay's exec).
- ``WORKDIR [path]`` (relative to the previous one, else ``/``) creates the directory, owned by the current
  user from the first directory it had to create, as E2B does.
- ``USER [name]`` creates the user (``useradd --create-home``) when the image lacks it.
- ``startCmd`` becomes the template's start command (``/bin/bash -l -c``) with ``readyCmd`` as its
  readiness check; a ``readyCmd`` without a start command runs once as the last step and must exit 0.
- ``force`` (E2B's ``skip_cache``): the body's own (``Template.build(skip_cache=True)``, or ``skip_cache()``
  before the base) rebuilds every step without the layer cache; a step's (``skip_cache()`` before it, which the
  SDK then sets on every later step too) rebuilds from that step on (``BuildSpec.no_cache_from``).

``fromImage`` names E2B's base (``e2bdev/base``, the SDK's default) -> podbay ``base``; a podbay template
(``podbay/NAME`` or ``NAME``) -> that template. Anything else is an image in a registry, which podbay does not
reach: :class:`E2bBuildError` (HTTP 400). Errors name the step (1-based, as E2B's SDK counts them).
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from podbay.contracts.templates import TEMPLATE_NAME_RE, BuildSpec, CopyStep, FromRef, ImageConfig, RunStep
from podbay.errors import InvalidRequest

__all__ = [
    "E2bStep",
    "E2bBuildStart",
    "E2bBuildError",
    "Translation",
    "E2B_BASE_IMAGES",
    "DEFAULT_USER",
    "files_dir",
    "translate",
    "render",
]

#: E2B's base image names (the SDK's default ``fromImage``): podbay's ``base`` stands in for them.
E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base", "docker.io/e2bdev/base:latest")
#: The user E2B's build steps run as unless told otherwise.
DEFAULT_USER = "user"
_GLOB = re.compile(r"[*?\[{]")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?$")
_MODE = re.compile(r"^[0-7]{3,4}$")
_HASH = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_SHELL = ["/bin/bash", "-l", "-c"]


class E2bBuildError(InvalidRequest):
    """A build podbay cannot run as asked (400); ``details``: ``step`` (1-based, E2B's numbering) when a
    step is at fault."""

    code = "invalid_e2b_build"


class E2bStep(BaseModel):
    """E2B's ``TemplateStep``: ``type`` (RUN, COPY, ENV, WORKDIR, USER), ``args``, ``filesHash`` (COPY)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: str = Field(min_length=1, max_length=32)
    args: list[str] = Field(default_factory=list, max_length=4096)
    files_hash: str | None = Field(None, alias="filesHash")
    force: bool | None = False


class E2bBuildStart(BaseModel):
    """E2B's ``TemplateBuildStartV2`` (the body of ``POST /v2/templates/{id}/builds/{buildID}``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    from_image: str | None = Field(None, alias="fromImage", max_length=1024)
    from_template: str | None = Field(None, alias="fromTemplate", max_length=256)
    from_image_registry: dict[str, object] | None = Field(None, alias="fromImageRegistry")
    force: bool | None = False
    steps: list[E2bStep] = Field(default_factory=list, max_length=1000)
    start_cmd: str | None = Field(None, alias="startCmd", max_length=64 << 10)
    ready_cmd: str | None = Field(None, alias="readyCmd", max_length=64 << 10)


@dataclass
class Translation:
    """What :func:`translate` makes: the ``spec``; ``origins[i]``: the E2B step (1-based) that podbay step
    ``i + 1`` comes from (0: none, e.g. the ready check); ``files``: the COPY archives it reads (hashes, in
    order, once each); ``from_image``: whether the base was named as an image (for the API's message when
    no such template exists)."""

    spec: BuildSpec
    origins: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    from_image: bool = False


def files_dir(files_hash: str) -> str:
    """Where a COPY step's uploaded archive is unpacked in the build context (a relative path)."""
    return f"e2b-files/{files_hash}"


def _base(body: E2bBuildStart) -> tuple[FromRef, bool]:
    if body.from_image_registry:
        raise E2bBuildError("fromImageRegistry: podbay pulls no images from a registry; build from a podbay "
                            "template (from_template('base'))", details={"step": "base"})
    if body.from_template:
        name = body.from_template.removeprefix("podbay/").removesuffix(":latest").removesuffix(":default")
        if not re.fullmatch(TEMPLATE_NAME_RE, name):
            raise E2bBuildError(f"fromTemplate {body.from_template!r} is not a podbay template name ([a-z0-9-])",
                                details={"step": "base"})
        return FromRef(kind="template", ref=name), False
    image = body.from_image or E2B_BASE_IMAGES[0]
    if image in E2B_BASE_IMAGES:
        return FromRef(kind="template", ref="base"), False
    name = image.removeprefix("podbay/").removesuffix(":latest")
    if re.match(TEMPLATE_NAME_RE, name):
        return FromRef(kind="template", ref=name), True
    raise E2bBuildError(f"fromImage {image!r}: podbay reaches no image registry, so it builds only from "
                        "e2bdev/base (podbay's base) and podbay templates (from_template('base'), "
                        "from_image('podbay/NAME'))", details={"step": "base", "image": image})


def _home(user: str) -> str:
    return "/root" if user in ("root", "0") else f"/home/{user}"


def _expand(value: str, env: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


def _source(src: str, index: int) -> str:
    """The context-relative part of a COPY source E2B copies: the pattern's directory part for a glob."""
    if src.startswith("/") or ".." in src.split("/"):
        raise E2bBuildError(f"step {index}: COPY source {src!r} must be a relative path inside the context",
                            details={"step": str(index)})
    parts = [p for p in src.split("/") if p not in ("", ".")]
    static: list[str] = []
    for p in parts:
        if _GLOB.search(p):
            break
        static.append(p)
    return "/".join(static)


@dataclass
class _State:
    env: dict[str, str]
    user: str
    workdir: str | None

    def cwd(self) -> str:
        return self.workdir or _home(self.user)


def _copy_targets(src_rel: str, dest: str, members: set[str] | None) -> tuple[bool, list[str]]:
    """(is the source a directory, the guest paths the copy writes) given the archive's ``members``."""
    names = members or set()
    is_dir = src_rel == "" or any(n.startswith(src_rel + "/") for n in names)
    if not is_dir:
        target = dest + posixpath.basename(src_rel) if dest.endswith("/") else dest
        return False, [target]
    root = dest.rstrip("/") or "/"
    prefix = src_rel + "/" if src_rel else ""
    under = sorted(n[len(prefix):] for n in names if n.startswith(prefix) and n != src_rel)
    return True, [posixpath.join(root, n) for n in under if n]


def translate(body: E2bBuildStart, *, parent: ImageConfig | None = None,
              members: Mapping[str, set[str]] | None = None) -> Translation:
    """E2B's build body as a podbay :class:`Translation`.

    ``parent``: the FROM template's config (its user and working directory are where E2B's steps start);
    ``members``: for each files hash, the paths in its uploaded archive (relative, no leading ``./``), which
    tell a file from a directory for ``mode``. Raises :class:`E2bBuildError` (400) for a step podbay cannot
    build, naming it.
    """
    base, from_image = _base(body)
    st = _State(env=dict(parent.env) if parent else {}, user=(parent.user if parent and parent.user else
                                                                DEFAULT_USER),
                workdir=parent.workdir if parent else None)
    steps: list[RunStep | CopyStep] = []
    origins: list[int] = []
    files: list[str] = []

    def run(cmd: str, index: int, *, user: str | None = None, cwd: str | None = None) -> None:
        steps.append(RunStep(argv=[*_SHELL, cmd], env=dict(st.env), workdir=cwd or st.cwd(), user=user or st.user,
                             line=index))
        origins.append(index)

    for index, step in enumerate(body.steps, 1):
        kind = step.type.upper()
        args = step.args
        where = {"step": str(index)}
        if kind == "RUN":
            if not args or not args[0].strip():
                raise E2bBuildError(f"step {index}: RUN needs a command", details=where)
            user = args[1] if len(args) > 1 and args[1] else None
            if user is not None and not _NAME.match(user):
                raise E2bBuildError(f"step {index}: RUN user {user!r} is not a user name", details=where)
            run(args[0], index, user=user.split(":", 1)[0] if user else None)
        elif kind == "COPY":
            if len(args) < 2 or not args[1]:
                raise E2bBuildError(f"step {index}: COPY needs a source and a destination", details=where)
            if not step.files_hash or not _HASH.fullmatch(step.files_hash):
                raise E2bBuildError(f"step {index}: COPY needs a filesHash", details=where)
            owner = args[2] if len(args) > 2 and args[2] else st.user
            mode = args[3] if len(args) > 3 and args[3] else None
            if not _NAME.match(owner):
                raise E2bBuildError(f"step {index}: COPY owner {owner!r} is not USER[:GROUP]", details=where)
            if mode is not None and not _MODE.match(mode):
                raise E2bBuildError(f"step {index}: COPY mode {mode!r} is not octal (e.g. 0755)", details=where)
            src_rel = _source(args[0], index)
            dest = args[1] if args[1].startswith("/") else posixpath.join(st.cwd(), args[1])
            keep_slash = dest.endswith("/")
            dest = posixpath.normpath(dest) + ("/" if keep_slash and dest != "/" else "")
            if step.files_hash not in files:
                files.append(step.files_hash)
            source = files_dir(step.files_hash) + (f"/{src_rel}" if src_rel else "")
            steps.append(CopyStep(sources=[source], dest=dest, chown=owner, line=index))
            origins.append(index)
            if mode is not None:
                _, targets = _copy_targets(src_rel, dest, (members or {}).get(step.files_hash))
                if targets:
                    run(f"chmod {mode} -- {' '.join(shlex.quote(t) for t in targets)}", index, user="root", cwd="/")
        elif kind == "ENV":
            if not args or len(args) % 2:
                raise E2bBuildError(f"step {index}: ENV needs KEY, VALUE pairs", details=where)
            for key, value in zip(args[::2], args[1::2], strict=True):
                if not _ENV_KEY.match(key):
                    raise E2bBuildError(f"step {index}: ENV {key!r} is not a variable name", details=where)
                st.env[key] = _expand(value, {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                              **st.env})
        elif kind == "WORKDIR":
            if not args or not args[0]:
                raise E2bBuildError(f"step {index}: WORKDIR needs a path", details=where)
            path = posixpath.normpath(posixpath.join(st.workdir or "/", args[0]))
            owner = "" if st.user in ("root", "0") else f' && chown -R {shlex.quote(st.user)}: "$c"'
            # Create it, and give the user what had to be created (the first missing directory down).
            run(f't={shlex.quote(path)}; c="$t"; while [ ! -e "$(dirname "$c")" ]; do c="$(dirname "$c")"; done; '
                f'if [ ! -e "$t" ]; then mkdir -p "$t"{owner}; fi', index, user="root", cwd="/")
            st.workdir = path
        elif kind == "USER":
            if not args or not _NAME.match(args[0]):
                raise E2bBuildError(f"step {index}: USER needs a user name", details=where)
            user = args[0].split(":", 1)[0]
            if user not in ("root", "0"):
                q = shlex.quote(user)
                extra = (f" && (usermod -aG sudo {q} 2>/dev/null || true) && passwd -d {q} >/dev/null"
                         f" && echo '{user} ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/90-{user}"
                         if len(args) > 1 and args[1] == "true" else "")
                run(f"(id -u {q} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash {q}){extra}", index,
                    user="root", cwd="/")
            st.user = user
        else:
            raise E2bBuildError(f"step {index}: {step.type!r} is not a step podbay builds (RUN, COPY, ENV, "
                                "WORKDIR, USER)", details=where)
    start = [*_SHELL, body.start_cmd] if body.start_cmd else None
    ready = body.ready_cmd if body.ready_cmd else None
    if ready is not None and start is None:
        run(ready, 0)  # a check with nothing to wait for: it must pass once
        ready = None
    config = ImageConfig(env=st.env, workdir=st.workdir, user=st.user, start_cmd=start,
                         ready_cmd=ready if start else None)
    spec = BuildSpec(base=base, steps=steps, config=config, no_cache_from=_no_cache_from(body, origins))
    return Translation(spec=spec, origins=origins, files=files, from_image=from_image)


def _no_cache_from(body: E2bBuildStart, origins: list[int]) -> int | None:
    """The first podbay step to build without the cache: 0 for the body's ``force``; for a step's, the first
    podbay step made from that E2B step or a later one, or the ready check (``len(origins)`` when none is: an
    ENV step makes no podbay step, and then only the start command's snapshot is built again); None when
    nothing is forced."""
    if body.force:
        return 0
    first = next((i for i, s in enumerate(body.steps, 1) if s.force), None)
    if first is None:
        return None
    return next((j for j, o in enumerate(origins) if o >= first or o == 0), len(origins))


def render(body: E2bBuildStart) -> str:
    """A readable text of the build (kept as the build's recipe in ``template_builds.dockerfile``)."""
    lines = [f"# E2B template build\nFROM {body.from_template or body.from_image or E2B_BASE_IMAGES[0]}"]
    lines += [f"{s.type.upper()} {json.dumps(s.args)}" for s in body.steps]
    if body.start_cmd:
        lines.append(f"START {json.dumps(body.start_cmd)}")
    if body.ready_cmd:
        lines.append(f"READY {json.dumps(body.ready_cmd)}")
    return "\n".join(lines) + "\n"
