"""Fault injection for crash tests: ``PODBAY_FAULT_STEP`` names a step at which the process SIGKILLs itself.

Steps are ``<operation>.<point>`` (``promote.manifest``, ``promote.uploaded``, ``suspend.snapshotted``,
``suspend.promoted``, ``resume.fetched``, ``vm.spawned``, ...; README.md "Configuration" lists them). Production never sets it.
The kill is abrupt on purpose: no ``finally`` runs, as with a power cut or the OOM killer.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["fault_point"]

log = logging.getLogger("podbay.faults")


def fault_point(step: str) -> None:
    """SIGKILL this process when ``PODBAY_FAULT_STEP`` equals ``step``; otherwise return at once."""
    if os.environ.get("PODBAY_FAULT_STEP") == step:
        log.warning("fault injection: killing this process at step %s", step)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
