"""E2B's REST API, mounted at ``/e2b`` (docs/e2b.md): one adapter over the same services as ``/v1``. The
modules map E2B's sandboxes (``sandboxes``), network options, secrets, snapshots, templates and volumes onto
podbay's; ``common`` holds what they share (E2B's error shape, the ``X-API-KEY`` caller). E2B's in-sandbox
envd traffic is proxied by ``..edge.envd``."""
