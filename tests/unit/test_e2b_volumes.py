"""E2B's volume API on podbay (services/api/e2b/volumes.py): ``volumeMounts`` -> podbay's ``volumes``, and the
volume content API's refusals before any lookup."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from podbay.contracts.volumes import VolumeMount
from podbay.errors import InvalidRequest
from podbay_api.e2b.sandboxes import NewSandbox
from podbay_api.e2b.volumes import VolumeMountBody, router, volume_content_token, volume_mounts


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


async def test_volume_content_calls_are_refused_before_any_lookup_without_the_volumes_token() -> None:
    """No database here: every call below is answered before the volume is looked up."""
    from types import SimpleNamespace

    app = FastAPI()
    app.include_router(router)
    app.state.ctx = SimpleNamespace(settings=SimpleNamespace(internal_token="secret"))
    token = volume_content_token("secret", "vol_x")
    assert token != volume_content_token("secret", "vol_y") and token != volume_content_token("other", "vol_x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for method, path, auth in (("GET", "/e2b/volumecontent/vol_x/file?path=/a", None),
                                   ("PUT", "/e2b/volumecontent/vol_x/file?path=/a", "Bearer wrong"),
                                   ("DELETE", "/e2b/volumecontent/vol_x/path?path=/a", f"Basic {token}"),
                                   ("POST", "/e2b/volumecontent/vol_y/dir?path=/a", f"Bearer {token}")):
            r = await client.request(method, path, headers={"authorization": auth} if auth else {})
            assert r.status_code == 401 and r.json()["code"] == 401, (method, path, r.text)
        ok = {"authorization": f"Bearer {token}"}
        for method, path, status in (("GET", "/e2b/volumecontent/vol_x/other?path=/a", 404),
                                     ("GET", "/e2b/volumecontent/vol%5Fx/file?path=/a", 404),
                                     ("POST", "/e2b/volumecontent/vol_x/file?path=/a", 405),
                                     ("PUT", "/e2b/volumecontent/vol_x/dir?path=/a", 405)):
            r = await client.request(method, path, headers=ok)
            assert r.status_code == status and r.json()["code"] == status, (method, path, r.text)
