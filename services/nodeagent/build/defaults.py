"""The defaults of exec in a sandbox of a built template: its ENV, WORKDIR and USER (``ImageConfig``).

The node's data plane asks :meth:`ExecDefaults.get` once per sandbox (the sandbox's template build, from
PostgreSQL, then that build's ``template.json`` in the node store) and remembers the answer: a sandbox keeps
its build for life. :func:`apply` merges them under what a request says (its own env wins, as do its cwd
and user when given).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import TYPE_CHECKING

from podbay.contracts.api import ExecRequest
from podbay.contracts.templates import ImageConfig

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["ExecDefaults", "apply"]

_KEEP = 4096


def apply(body: ExecRequest, cfg: ImageConfig | None) -> ExecRequest:
    """``body`` with the template's defaults filled in under it."""
    if cfg is None or not (cfg.env or cfg.workdir or cfg.user):
        return body
    return body.model_copy(update={
        "env": {**cfg.env, **body.env},
        "cwd": body.cwd if body.cwd is not None else cfg.workdir,
        "user": body.user if body.user is not None else cfg.user,
    })


class ExecDefaults:
    """Per-sandbox template config, looked up once (LRU of the last 4096 sandboxes)."""

    def __init__(self, manager: SandboxManager) -> None:
        self.m = manager
        self._cache: OrderedDict[str, ImageConfig | None] = OrderedDict()

    async def get(self, sandbox_id: str) -> ImageConfig | None:
        if not any(t.snapshot.config is not None for t in self.m.templates.values()):
            return None  # only built-in templates here: no lookup on the exec path
        if sandbox_id in self._cache:
            self._cache.move_to_end(sandbox_id)
            return self._cache[sandbox_id]
        row = await self.m.pool.fetchrow("SELECT template, template_digest FROM sandboxes WHERE id=$1", sandbox_id)
        cfg: ImageConfig | None = None
        if row is not None:
            img = self.m.templates.get(row["template"])
            if img is None or img.digest != row["template_digest"]:
                img = await asyncio.to_thread(self.m.driver.find_template, row["template"], row["template_digest"])
            cfg = img.snapshot.config if img is not None else None
        self._cache[sandbox_id] = cfg
        while len(self._cache) > _KEEP:
            self._cache.popitem(last=False)
        return cfg
