"""The ``podbay`` command line: sandboxes, exec, files, templates and the dev stack, over the HTTP API.

Commands are documented in docs/cli.md. Where the API is: ``--api-url``/``--api-key``, else
``PODBAY_API_URL``/``PODBAY_API_KEY``, else the config file ``podbay up`` writes. Exit codes and the
error line are described in ``podbay.cli._common``.
"""

from __future__ import annotations

import typer

from podbay.cli import access, files, node, pool, sandbox, snapshot, stack, template
from podbay.cli._common import CliState, OneLineErrorsGroup
from podbay.cli.exec_cmd import exec_command

__all__ = ["app", "main"]

app = typer.Typer(
    name="podbay",
    cls=OneLineErrorsGroup,
    help="podbay: microVM sandboxes for long-running AI agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(files.app, name="files")
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(pool.app, name="pool")
app.add_typer(node.app, name="node")
app.add_typer(access.credential_app, name="credential")
app.add_typer(access.key_app, name="key")
sandbox.app.add_typer(access.network_app, name="network")
app.command("audit")(access.audit)
app.add_typer(template.template_app, name="template")
app.add_typer(template.operation_app, name="operation")
app.command("exec")(exec_command)
app.command("env")(stack.env)
app.command("up")(stack.up)
app.command("down")(stack.down)
app.command("status")(stack.status)


@app.callback()
def _global(
    ctx: typer.Context,
    api_url: str | None = typer.Option(None, "--api-url", help="API base URL (default: PODBAY_API_URL, config)."),
    api_key: str | None = typer.Option(None, "--api-key", help="API key (default: PODBAY_API_KEY, config)."),
) -> None:
    ctx.obj = CliState(api_url=api_url, api_key=api_key)


def main() -> None:
    """Entry point of the ``podbay`` script."""
    app()


if __name__ == "__main__":
    main()
