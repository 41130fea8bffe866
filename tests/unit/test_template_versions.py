"""Template references with tags (``web:v2``): parsing and validation at each boundary (contracts, the API's
create body, the node's build request, the SDK's delete, the CLI's listing)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from podbay.cli.template import _tags
from podbay.contracts.api import SandboxCreate
from podbay.contracts.templates import (
    BuildSpec,
    FromRef,
    NodeBuildRequest,
    TemplateDetail,
    TemplateTag,
    split_template_ref,
)
from podbay.errors import InvalidRequest
from podbay.sdk._calls import delete_template_call
from podbay.sdk._templates import build_call


@pytest.mark.parametrize(("ref", "want"), [
    ("web", ("web", None)),
    ("web:v2", ("web", "v2")),
    ("web:1.0_rc-1", ("web", "1.0_rc-1")),
    ("web:" + "a" * 64, ("web", "a" * 64)),
])
def test_good_refs_split(ref: str, want: tuple[str, str | None]) -> None:
    assert split_template_ref(ref) == want


@pytest.mark.parametrize("ref", ["web:", "web:V2", "web:.v2", "web:-v2", "web:v/2", "web:a:b", "Web:v2",
                                 ":v2", "web:" + "a" * 65])
def test_bad_refs_are_refused_everywhere(ref: str) -> None:
    with pytest.raises(ValueError, match="template (name|tag)"):
        split_template_ref(ref)
    with pytest.raises(ValidationError):
        SandboxCreate(template=ref)
    with pytest.raises(InvalidRequest):
        delete_template_call(ref)


def test_create_body_and_node_request_take_a_tag() -> None:
    assert SandboxCreate(template="web:v2").template == "web:v2"
    spec = BuildSpec(base=FromRef(kind="template", ref="base"))
    assert NodeBuildRequest(build_id="b", name="web", spec=spec, tag="v2").tag == "v2"
    with pytest.raises(ValidationError):
        NodeBuildRequest(build_id="b", name="web", spec=spec, tag="V2")
    with pytest.raises(ValidationError):
        NodeBuildRequest(build_id="b", name="web:v2", spec=spec)  # the name travels without its tag
    assert delete_template_call("web:v2").path == "/v1/templates/web%3Av2"


@pytest.mark.parametrize("ref", ["web:V2", "web:", "Web", "web:v2:v3"])
def test_a_bad_reference_is_the_same_error_on_build_and_removal(ref: str, tmp_path: Path) -> None:
    for call in (lambda: delete_template_call(ref), lambda: build_call(ref, "FROM base\n", tmp_path, None)):
        with pytest.raises(InvalidRequest, match="invalid template"):
            call()


def test_listing_marks_tags_of_other_builds() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    tpl = TemplateDetail(name="web", digest="bbbb" * 16, memory_mib=256, vcpus=1, created_at=at, tags=[
        TemplateTag(tag="v1", digest="aaaa" * 16, memory_mib=256, vcpus=1, created_at=at),
        TemplateTag(tag="v2", digest="bbbb" * 16, memory_mib=256, vcpus=1, created_at=at)])
    assert _tags(tpl) == "v1@aaaaaaaaaaaa,v2"
    assert _tags(tpl.model_copy(update={"tags": []})) == "-"
