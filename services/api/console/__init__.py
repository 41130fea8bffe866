"""The web console (docs/console.md): ``routes`` (the page, its assets, sign-in), ``session`` (session cookie
and CSRF, also used by ``deps.principal_dep``) and ``pty`` (the terminal WebSocket). Sources of the page are
in ``web/``, built into ``static/`` by scripts/setup.sh."""
