"""Thin FastAPI routers of ``/v1``: parse the request, authorise the caller, call a service (``..services``) or
the node client (``..nodes_client``), shape the answer. A route module never imports another route module
(tests/unit/test_api_layout.py checks it)."""
