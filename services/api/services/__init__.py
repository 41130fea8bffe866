"""The API's logic, free of FastAPI's request types: sandboxes, snapshots, volumes, templates, quotas,
idempotency keys and the warm claim. The routes of ``/v1`` and E2B's adapter (``..e2b``) both call these."""
