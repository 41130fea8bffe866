"""podbay-gateway: the per-node egress gateway (docs/DESIGN.md §6; docs/egress.md).

Every TCP connection and DNS query leaving a sandbox arrives here (the node's nftables rules redirect them).
The gateway identifies the sandbox by its source address, decides by its egress policy, injects credentials
into requests to destinations that have them (TLS terminated with the sandbox's own CA), redacts their
values from responses, and audits every denial and credential use.

Only :mod:`.proxy` imports mitmproxy; everything else runs in the main virtualenv and is unit-tested there.
"""
