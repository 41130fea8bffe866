"""Who may read ``/metrics`` (docs/SECURITY.md, "client vs operator"): the Prometheus text of a process names
its routes, hops and outcomes, never tenant or sandbox ids (``podbay.telemetry``), but it still tells load and
failure patterns of every tenant, so it is the operator's.

- The API's ``/metrics`` (on the public API port) answers ``Authorization: Bearer <PODBAY_METRICS_TOKEN>`` or
  a key of the operator tenant (``PODBAY_OPERATOR_TENANT``); anything else is 401 ``unauthorized`` (no or a
  bad credential) or 403 ``forbidden`` (another tenant's key).
- The other services' health ports (scheduler, snapshotter, warm pool, gateway) bind ``PODBAY_HEALTH_HOST``
  (loopback by default); when ``PODBAY_METRICS_TOKEN`` is set their ``/metrics`` needs it too, so a port
  opened to Prometheus (``0.0.0.0`` in Kubernetes) is not anonymous.
"""

from __future__ import annotations

import hmac
import json

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from podbay.errors import Unauthorized

__all__ = ["bearer", "token_matches", "metrics_response", "unauthorized_response"]


def bearer(authorization: str | None) -> str | None:
    """The credential of ``Authorization: Bearer <credential>`` (``None`` when the header is absent or of
    another scheme)."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return None
    return authorization[7:].strip() or None


def token_matches(authorization: str | None, token: str) -> bool:
    """Whether ``authorization`` is ``Bearer <token>`` (constant-time); an empty ``token`` never matches."""
    given = bearer(authorization)
    return bool(token) and given is not None and hmac.compare_digest(given.encode(), token.encode())


def metrics_response() -> Response:
    """This process's metrics in the Prometheus text format."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def unauthorized_response(message: str) -> Response:
    """401 ``unauthorized`` in the wire error shape, with the ``WWW-Authenticate`` a scraper expects."""
    return Response(json.dumps(Unauthorized(message).to_wire()), status_code=401, media_type="application/json",
                    headers={"www-authenticate": "Bearer"})
