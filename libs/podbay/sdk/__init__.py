"""The podbay Python SDK: sandboxes over the HTTP API (blocking and asyncio).

    from podbay.sdk import Sandbox
    with Sandbox.create(template="base") as sb:
        result = sb.exec("echo hello")          # ExecResult(stdout="hello\\n", exit_code=0, ...)
        for event in sb.exec_stream(["python3", "-u", "job.py"]):
            ...                                 # ExecEvent: start, stdout/stderr (data), exit (exit_code)

- ``Sandbox``/``AsyncSandbox``: one sandbox (create, connect, exec, files, delete; context managers).
- ``Client``/``AsyncClient``: the whole API as flat methods on one pooled connection; pass ``client=``
  to ``Sandbox.create``/``connect`` to share it among many sandboxes.
- ``client.credentials`` / ``client.keys`` namespaces, ``client.audit(...)``, ``sb.set_network(policy)`` and
  ``Sandbox.create(..., network=policy)``: credentials (values are write-only), API keys, the audit log and
  egress policy (docs/credentials.md).
- ``client.events(sandbox=, types=, after=, follow=)``: the tenant's lifecycle events (``EventOut`` with
  ``.seq``, the position to resume after), a sync or async iterator; ``client.webhooks`` namespace.
- Results are the pydantic models of ``podbay.contracts.api``; errors are the ``podbay.errors`` classes
  (re-exported here), carrying the server's ``code``, ``message`` and ``details``.

Where the API is: ``api_url``/``api_key`` arguments, else ``PODBAY_API_URL``/``PODBAY_API_KEY``, else the
config file ``podbay up`` writes (``podbay.clientconfig``). See docs/sdk.md.
"""

from __future__ import annotations

from podbay.contracts.access import AuditEntry, AuditPage, CredentialInfo, KeyCreated, KeyInfo, NetworkInfo
from podbay.contracts.api import ExecEvent, ExecResult, FileInfo, OperationInfo, SandboxInfo, TemplateInfo
from podbay.contracts.templates import BuildEvent, TemplateDetail
from podbay.sdk._templates import TemplateBuildFailed
from podbay.errors import (
    Conflict,
    GuestError,
    InvalidRequest,
    InvalidState,
    NoCapacity,
    NotFound,
    NoSpace,
    NotWritable,
    PermissionDenied,
    PodbayError,
    SnapshotCorrupt,
    StaleGeneration,
    StorageError,
    SuspendFailed,
    Timeout,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from podbay.contracts.egress import EgressPolicy, EgressRule
from podbay.contracts.events import EventOut, WebhookCreated, WebhookInfo
from podbay.sdk._async import AsyncClient, AsyncFiles, AsyncSandbox
from podbay.sdk._http import DEFAULT_TIMEOUT_S
from podbay.sdk._sync import Client, Files, Sandbox

__all__ = [
    "Sandbox",
    "AsyncSandbox",
    "Client",
    "AsyncClient",
    "Files",
    "AsyncFiles",
    "ExecResult",
    "ExecEvent",
    "SandboxInfo",
    "FileInfo",
    "OperationInfo",
    "TemplateInfo",
    "TemplateDetail",
    "BuildEvent",
    "TemplateBuildFailed",
    "EgressPolicy",
    "EgressRule",
    "CredentialInfo",
    "KeyInfo",
    "KeyCreated",
    "AuditEntry",
    "AuditPage",
    "NetworkInfo",
    "EventOut",
    "WebhookCreated",
    "WebhookInfo",
    "DEFAULT_TIMEOUT_S",
    "PodbayError",
    "SnapshotCorrupt",
    "StorageError",
    "SuspendFailed",
    "InvalidRequest",
    "Unauthorized",
    "NotFound",
    "NotWritable",
    "Conflict",
    "InvalidState",
    "Unprocessable",
    "Timeout",
    "Unavailable",
    "NoCapacity",
    "StaleGeneration",
    "GuestError",
    "PermissionDenied",
    "NoSpace",
]
