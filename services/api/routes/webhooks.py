"""``/v1/webhooks``: a tenant's webhooks (create with a once-shown secret, list with delivery state, delete).

Delivery itself is ``podbay.webhooks.Deliverer``, run as a background task of every API process (see
``app.py``): the API already holds the PostgreSQL pool and the NATS connection, replicas share one durable
consumer so an event is delivered by one of them, and scaling the API scales delivery. Changes are audited
(``webhook.create``, ``webhook.delete``); the secret never is.

Unless ``PODBAY_WEBHOOK_ALLOW_PRIVATE`` is on, a URL whose host is ``localhost`` or an IP literal that is not
public (loopback, link-local such as the cloud metadata address, private, ...) is refused with 422
``validation_error``, as other malformed URLs are; names are checked again at every delivery, resolved.
"""

from __future__ import annotations

import secrets
from typing import Annotated

import asyncpg
import httpx
from fastapi import APIRouter, Depends, Path

from podbay.audit import record
from podbay.contracts.events import WebhookCreate, WebhookCreated, WebhookInfo, WebhookList
from podbay.errors import InvalidRequest, NotFound, Unprocessable
from podbay.outbox import new_id
from podbay.webhooks import ALLOW_PRIVATE_SETTING, refused_host

from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep, principal_dep
from ..services import webhooks

__all__ = ["router", "MAX_WEBHOOKS", "check_destination"]

router = APIRouter(prefix="/v1")

CtxDep = Annotated[ApiContext, Depends(ctx_dep)]
PrincipalDep = Annotated[Principal, Depends(principal_dep)]

#: Webhooks one tenant may have (each event fans out to all of them).
MAX_WEBHOOKS = 20



def _info(r: asyncpg.Record) -> WebhookInfo:
    return WebhookInfo(id=r["id"], url=r["url"], types=list(r["types"]), created_at=r["created_at"],
                       deliveries=r["deliveries"], failures=r["failures"], last_status=r["last_status"],
                       last_attempts=r["last_attempts"], last_error=r["last_error"],
                       last_event_seq=r["last_event_seq"], last_attempt_at=r["last_attempt_at"])


def check_destination(url: str, *, allow_private: bool) -> None:
    """Refuse a webhook URL the API must not POST to: ``Unprocessable`` (422 ``validation_error``) with
    ``details`` ``{"url", "host", "setting"}`` when ``url`` does not parse, or when ``allow_private`` is off and
    its host is ``localhost`` or a non-public IP literal (:func:`podbay.webhooks.refused_host`)."""
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL as exc:
        raise Unprocessable(f"url: not a valid URL: {exc}", details={"url": url}) from exc
    reason = None if allow_private else refused_host(host)
    if reason is not None:
        raise Unprocessable(
            f"url: {reason}; webhooks may only go to public addresses (set {ALLOW_PRIVATE_SETTING}=1 on the API "
            "to allow loopback and private destinations)",
            details={"url": url, "host": host, "setting": ALLOW_PRIVATE_SETTING})


@router.post("/webhooks", status_code=201, response_model=WebhookCreated)
async def create_webhook(ctx: CtxDep, who: PrincipalDep, body: WebhookCreate) -> WebhookCreated:
    """Add a webhook; the answer carries its signing ``secret``, shown this once. 400 past ``MAX_WEBHOOKS``;
    422 ``validation_error`` for a URL to a non-public address (see :func:`check_destination`)."""
    check_destination(body.url, allow_private=ctx.settings.webhook_allow_private)
    hook_id = new_id("whk")
    secret = "whsec_" + secrets.token_hex(24)
    async with ctx.pool.acquire() as conn, conn.transaction():
        count = await webhooks.count_live(conn, who.tenant_id)
        if count >= MAX_WEBHOOKS:
            raise InvalidRequest(f"a tenant may have at most {MAX_WEBHOOKS} webhooks")
        row = await webhooks.insert(conn, hook_id, who.tenant_id, body.url, sorted(set(body.types)), secret)
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action="webhook.create", target=hook_id,
                     detail={"url": body.url, "types": sorted(set(body.types))})
    ctx.relay.kick()
    return WebhookCreated(**_info(row).model_dump(), secret=secret)


@router.get("/webhooks", response_model=WebhookList)
async def list_webhooks(ctx: CtxDep, who: PrincipalDep) -> WebhookList:
    """The tenant's webhooks with the state of their last delivery, oldest first."""
    rows = await webhooks.list_live(ctx.pool, who.tenant_id)
    return WebhookList(webhooks=[_info(r) for r in rows])


@router.delete("/webhooks/{webhook_id}", response_model=WebhookInfo)
async def delete_webhook(ctx: CtxDep, who: PrincipalDep,
                         webhook_id: str = Path(max_length=64)) -> WebhookInfo:
    """Stop deliveries to a webhook (events in flight may still arrive once). 404 ``not_found``."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await webhooks.mark_deleted(conn, who.tenant_id, webhook_id)
        if row is None:
            raise NotFound(f"no webhook {webhook_id}")
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action="webhook.delete", target=webhook_id)
    ctx.relay.kick()
    return _info(row)
