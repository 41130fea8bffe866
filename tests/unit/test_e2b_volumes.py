"""E2B's volume API on podbay (services/api/e2b_volumes.py): ``volumeMounts`` -> podbay's ``volumes``, and the
volume content API's E2B-shaped refusal."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from podbay.contracts.volumes import VolumeMount
from podbay.errors import InvalidRequest
from podbay_api.e2b import NewSandbox
from podbay_api.e2b_volumes import CONTENT_NOT_SERVED, VolumeMountBody, router, volume_mounts


def test_sdk_volume_mounts_become_read_write_podbay_volumes_in_order() -> None:
    from e2b.api.client.models import NewSandbox as SdkNewSandbox
    from e2b.api.client.models import SandboxVolumeMount

    sdk = SdkNewSandbox(template_id="base", volume_mounts=[SandboxVolumeMount(name="data", path="/mnt/data"),
                                                           SandboxVolumeMount(name="cache", path="/home/user/c")])
    body = NewSandbox.model_validate(sdk.to_dict())
    assert volume_mounts(body.volume_mounts) == [VolumeMount(name="data", path="/mnt/data", readonly=False),
                                                 VolumeMount(name="cache", path="/home/user/c", readonly=False)]
    assert volume_mounts(NewSandbox.model_validate({"templateID": "base"}).volume_mounts) is None
    assert volume_mounts([]) is None


def test_a_volume_name_podbay_refuses_is_invalid_request_naming_the_entry() -> None:
    with pytest.raises(InvalidRequest, match=r"volumeMounts\.1\.name"):
        volume_mounts([VolumeMountBody(name="ok", path="/mnt/a"), VolumeMountBody(name="Bad Name", path="/mnt/b")])


async def test_volume_content_calls_answer_e2b_shaped_501() -> None:
    app = FastAPI()
    app.include_router(router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for method, path in (("GET", "/e2b/volumecontent/vol_x/file?path=/a"),
                             ("PUT", "/e2b/volumecontent/vol_x/file"), ("DELETE", "/e2b/volumecontent/vol_x/path"),
                             ("POST", "/e2b/volumecontent/vol_x/dir")):
            r = await client.request(method, path)
            assert r.status_code == 501
            assert r.json() == {"code": 501, "message": CONTENT_NOT_SERVED}
