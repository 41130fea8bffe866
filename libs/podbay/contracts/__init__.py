"""Contracts: the one source of truth for every message that crosses a process boundary.

- ``states``: sandbox lifecycle states, commands and the table of which is allowed where.
- ``subjects``: JetStream stream, subject, consumer and KV names.
- ``messages``: JetStream command and event payloads.
- ``api``: HTTP request and response bodies.
- ``channel``: guest channel operation payloads (the frame codec is ``podbay.channel.frames``).
"""
