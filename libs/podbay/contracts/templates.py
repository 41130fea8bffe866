"""Template builds (``/v1/templates``, docs/DESIGN.md §8): the parsed build spec and the build's wire shapes.

A Dockerfile (the subset in :mod:`podbay.dockerfile`) parses into a :class:`BuildSpec`: the parent template
(``FROM``), the ordered steps that change the disk (:class:`RunStep`, :class:`CopyStep`,
:class:`WorkdirStep`), and the image config (env, workdir, user, labels, start command, exposed ports) that
becomes the defaults of every exec in a sandbox of the template. Each disk step carries the env, working
directory and user it runs with, so a step's cache key (its JSON, :meth:`BuildStep.canonical`) changes when
anything it depends on does.

A build streams :class:`BuildEvent` lines (NDJSON): ``step`` (started, with ``cached``), ``log`` (output),
``done`` (the template) or ``failed`` (step, exit code, output tail).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from podbay.contracts.ids import SafeId

__all__ = [
    "TEMPLATE_NAME_RE",
    "TemplateName",
    "TEMPLATE_TAG_RE",
    "TEMPLATE_REF_RE",
    "TemplateTagName",
    "split_template_ref",
    "TemplateTag",
    "FromRef",
    "RunStep",
    "CopyStep",
    "WorkdirStep",
    "BuildStep",
    "ImageConfig",
    "BuildResources",
    "MEMORY_MIB_MIN",
    "MEMORY_MIB_MAX",
    "VCPUS_MIN",
    "VCPUS_MAX",
    "DISK_MIB_MIN",
    "DISK_MIB_MAX",
    "BuildSpec",
    "BuildState",
    "BuildEvent",
    "TemplateDetail",
    "TemplateDetailList",
    "step_text",
    "NodeBuildRequest",
    "BuildInfo",
    "BuildList",
]

#: Template names: lower-case letters, digits and dashes, starting with a letter or digit (a DNS label).
TEMPLATE_NAME_RE = r"^[a-z0-9][a-z0-9-]{0,62}$"
TemplateName = Annotated[str, StringConstraints(pattern=TEMPLATE_NAME_RE)]

#: A tag names one build (version) of a template: ``web:v2`` is the build tagged ``v2`` of ``web``. Lower-case
#: letters, digits, dots, underscores and dashes, starting with a letter or digit; at most 64 characters.
TEMPLATE_TAG_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
TemplateTagName = Annotated[str, StringConstraints(pattern=TEMPLATE_TAG_RE)]
#: What a create names: a template (its current build) or ``name:tag`` (the build the tag names).
TEMPLATE_REF_RE = r"^[a-z0-9][a-z0-9-]{0,62}(:[a-z0-9][a-z0-9._-]{0,63})?$"


def split_template_ref(ref: str) -> tuple[str, str | None]:
    """``"web"`` -> ``("web", None)``; ``"web:v2"`` -> ``("web", "v2")``. Raises ``ValueError`` (with a message
    for the user) when the name is not :data:`TEMPLATE_NAME_RE` or the tag not :data:`TEMPLATE_TAG_RE`."""
    name, sep, tag = ref.partition(":")
    if not re.fullmatch(TEMPLATE_NAME_RE, name):  # fullmatch: "$" alone lets a trailing newline through
        raise ValueError(f"template name {name!r} must be lower-case letters, digits and dashes "
                         "(at most 63, starting with a letter or digit)")
    if not sep:
        return name, None
    if not re.fullmatch(TEMPLATE_TAG_RE, tag):
        raise ValueError(f"template tag {tag!r} must be lower-case letters, digits, '.', '_' and '-' "
                         "(at most 64, starting with a letter or digit)")
    return name, tag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FromRef(_Strict):
    """What ``FROM`` names: a podbay template (``podbay/base``, ``podbay/web`` or ``web``) or an OCI image in
    skopeo's transport syntax (``oci:``, ``oci-archive:``, ``docker-archive:``, ``docker://``)."""

    kind: Literal["template", "oci"]
    ref: str = Field(description="The template name, or the skopeo image reference as written.")


class RunStep(_Strict):
    """``RUN``: a command in the builder guest. Exactly one of ``argv`` (exec form) or ``shell``."""

    op: Literal["run"] = "run"
    argv: list[str] | None = None
    shell: str | None = None
    env: dict[str, str] = Field(default_factory=dict, description="ENV plus ARG values in effect.")
    workdir: str = "/"
    user: str = "root"
    line: int = Field(0, description="1-based line of the instruction in the Dockerfile (not in the cache key).")


class CopyStep(_Strict):
    """``COPY``/``ADD``: context paths (relative, ``/``-separated, already checked to stay inside the context)
    to ``dest`` (absolute). ``add`` unpacks local tar archives as ADD does. ``digests``: sha256 of every copied
    file's path and bytes, filled by whoever holds the context (the builder), part of the cache key."""

    op: Literal["copy"] = "copy"
    sources: list[str] = Field(min_length=1)
    dest: str
    chown: str | None = None
    add: bool = False
    digests: str = ""
    line: int = 0


class WorkdirStep(_Strict):
    """``WORKDIR``: the directory is created (as ``mkdir -p``, owned by root, as Docker does)."""

    op: Literal["workdir"] = "workdir"
    path: str
    line: int = 0


BuildStep = Annotated[RunStep | CopyStep | WorkdirStep, Field(discriminator="op")]


def step_text(step: RunStep | CopyStep | WorkdirStep) -> str:
    """The canonical text of a step for its cache key: its JSON without the line number (a step moved down
    by a comment added above it is the same step)."""
    return json.dumps(step.model_dump(exclude={"line"}), sort_keys=True, separators=(",", ":"))


class ImageConfig(_Strict):
    """What a template's sandboxes get as defaults: exec env, working directory, user; the start command
    (ENTRYPOINT + CMD, with its readiness check), exposed ports and labels are recorded. A template with a
    start command is snapshotted with it running and ready, so every sandbox starts with it."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start_cmd: list[str] | None = None
    ready_cmd: str | None = Field(None, description="Shell command whose exit 0 says the start command is ready.")
    ready_port: int | None = Field(None, ge=1, le=65535, description="A TCP port on 127.0.0.1 that answers when "
                                   "the start command is ready.")
    expose: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


#: Bounds of a template's resources (a sandbox's are the template's: its memory is in the snapshot).
MEMORY_MIB_MIN, MEMORY_MIB_MAX = 128, 16384
VCPUS_MIN, VCPUS_MAX = 1, 16
DISK_MIB_MIN, DISK_MIB_MAX = 512, 256 << 10


class BuildResources(_Strict):
    """A build's resources; each absent one is the ``FROM`` template's. Memory and vCPUs are in a full
    snapshot's device state and RAM file, which a restore cannot change: a build that asks for other values
    than its parent's boots the parent's disk once with them (then snapshots it) instead of restoring the
    parent. ``disk_mib`` may only grow the parent's disk (its ext4 filesystem is grown to fit)."""

    memory_mib: int | None = Field(None, ge=MEMORY_MIB_MIN, le=MEMORY_MIB_MAX, description="Guest RAM, MiB.")
    vcpus: int | None = Field(None, ge=VCPUS_MIN, le=VCPUS_MAX, description="Guest vCPUs.")
    disk_mib: int | None = Field(None, ge=DISK_MIB_MIN, le=DISK_MIB_MAX,
                                 description="Root disk size, MiB; at least the FROM template's.")


class BuildSpec(_Strict):
    """A parsed Dockerfile: parent, disk steps in order, and the final config; and the build's resources."""

    base: FromRef
    steps: list[BuildStep] = Field(default_factory=list)
    config: ImageConfig = Field(default_factory=ImageConfig)
    resources: BuildResources = Field(default_factory=BuildResources)
    no_cache_from: int | None = Field(
        None, ge=0, description="Index (0-based) of the first step that runs without the layer cache: it and every "
        "later step, and the start command's snapshot, are built again into layers of this build's own "
        "(E2B's skip_cache/force). None: every step may be cached.")


class BuildState(StrEnum):
    """A build's state (``template_builds.state``)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class BuildEvent(BaseModel):
    """One line of a build's NDJSON stream.

    ``type``: ``step`` (a step starts; ``cached`` when its layer is reused), ``log`` (output ``text``),
    ``done`` (``template``: the registered :class:`TemplateDetail`), ``failed`` (``step``, ``exit_code`` when a
    RUN failed, ``code`` and ``message``, ``output_tail``).
    """

    type: Literal["step", "log", "done", "failed"]
    step: int | None = Field(None, description="1-based index among the disk steps; 0 for FROM/snapshot.")
    total: int | None = None
    text: str | None = None
    cached: bool | None = None
    elapsed_ms: float | None = None
    exit_code: int | None = None
    code: str | None = None
    message: str | None = None
    output_tail: str | None = None
    template: TemplateDetail | None = None


class TemplateTag(BaseModel):
    """A tag of a template: the build (version) it names, which creates of ``name:tag`` use and which the
    nodes keep while the tag exists."""

    tag: str
    digest: str
    memory_mib: int
    vcpus: int
    created_at: datetime


class TemplateDetail(BaseModel):
    """A template as ``GET /v1/templates`` lists it."""

    name: str
    digest: str = Field(description="The build's key (sha256 hex); a rebuild that changes anything is a new one.")
    memory_mib: int
    vcpus: int
    created_at: datetime
    parent: str | None = Field(None, description="The template it was built FROM; None for built-in ones.")
    config: ImageConfig | None = None
    size_bytes: int | None = Field(None, description="Bytes of its disk image (apparent size).")
    state: str = "ready"
    tags: list[TemplateTag] = Field(default_factory=list, description="Its tags, by name; a tag naming the "
                                    "current build has its digest.")


class TemplateDetailList(BaseModel):
    templates: list[TemplateDetail]


BuildEvent.model_rebuild()


class NodeBuildRequest(BaseModel):
    """The ``params`` form field of the node's ``POST /internal/v1/templates/build`` (the API's hop)."""

    model_config = ConfigDict(extra="forbid")

    build_id: SafeId = Field(description="The build's id (``bld_`` and 20 hex): the node names its build "
                             "folders after it, so it is one safe path component (podbay.naming.ID_RE).")
    name: TemplateName
    spec: BuildSpec
    tag: TemplateTagName | None = Field(None, description="Also tag the build so (``podbay template build "
                                        "web:v2``), in the same transaction as its registration.")


class BuildInfo(BaseModel):
    """One build of a template (``GET /v1/templates/{name}/builds``): ``state`` running, succeeded or failed;
    ``digest`` of the template it registered; ``error`` ``{code, message}`` when it failed (``interrupted``
    when the node agent restarted during it)."""

    id: str
    name: str
    state: BuildState
    parent: str | None = None
    digest: str | None = None
    error: dict[str, object] | None = None
    created_at: datetime
    finished_at: datetime | None = None


class BuildList(BaseModel):
    builds: list[BuildInfo]
