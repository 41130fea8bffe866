"""The API's edge: traffic proxied to a sandbox's guest rather than answered by a route. Guest ports by host
name or path (``ports``, decided by ``ports_access``), E2B's envd traffic (``envd``) and the TLS listener in
front of them (``tls``)."""
