"""The API process's core: its shared state (``context``), the caller's identity (``auth``, ``deps``), the error
shape every answer takes (``errors``), the request-body bound (``bodylimit``) and how the app is served
(``serving``). Everything else in the API imports these; they import nothing of it but the edge (``serving``)."""
