"""The ``podbay`` command line: sandboxes, exec, files, templates and the dev stack, over the HTTP API.

Commands are documented in docs/cli.md. Where the API is: ``--api-url``/``--api-key``, else
``PODBAY_API_URL``/``PODBAY_API_KEY``, else the config file ``podbay up`` writes. Exit codes and the
error line are described in ``podbay.cli._common``.

The commands that act on this host (``up``, ``down``, ``status``, ``template build``) come with the server
package: each ``podbay.cli`` entry point names a function that adds commands to ``app``
(``podbay.servercli.register``). Without the server package they still parse, and end with one line
naming the package to install (``unavailable``, exit 1).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

import typer

from podbay.cli import access, computer, env, events, files, node, pool, sandbox, schedule, snapshot, template, volume
from podbay.cli._common import CliState, OneLineErrorsGroup, fail
from podbay.cli.exec_cmd import exec_command
from podbay.cli.mcp_server import mcp_command
from podbay.cli.run_code import run_code_command

__all__ = ["app", "main", "PLUGIN_GROUP", "SERVER_PACKAGE"]

#: The entry-point group whose functions (``register(app)``) add commands to the CLI.
PLUGIN_GROUP = "podbay.cli"
#: The distribution that provides the host commands.
SERVER_PACKAGE = "podbay-server"
#: Commands the server package provides: ``(group, name)``, group ``None`` for the root.
_SERVER_COMMANDS = ((None, "up"), (None, "down"), (None, "status"), ("template", "build"))

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
app.add_typer(computer.app, name="computer")
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(schedule.app, name="schedule")
app.add_typer(volume.app, name="volume")
app.add_typer(pool.app, name="pool")
app.add_typer(node.app, name="node")
app.add_typer(access.credential_app, name="credential")
app.add_typer(access.key_app, name="key")
sandbox.app.add_typer(access.network_app, name="network")
app.command("audit")(access.audit)
app.command("events")(events.events)
app.add_typer(events.webhook_app, name="webhook")
app.add_typer(template.template_app, name="template")
app.add_typer(template.operation_app, name="operation")
app.command("exec")(exec_command)
app.command("run-code")(run_code_command)
app.command("env")(env.env)
app.command("mcp")(mcp_command)


def _needs_server(command: str) -> Callable[[typer.Context], None]:
    """A command that only says which package provides ``command``."""

    def missing(ctx: typer.Context) -> None:
        fail(f"`podbay {command}` comes with the server package: pip install {SERVER_PACKAGE}", "unavailable", 1)

    missing.__doc__ = f"Needs the server package (pip install {SERVER_PACKAGE})."
    return missing


def _load_plugins() -> None:
    """Add the commands of every installed ``podbay.cli`` entry point, and a placeholder for each host
    command none of them provided."""
    for ep in entry_points(group=PLUGIN_GROUP):
        ep.load()(app)
    groups = {None: app, "template": template.template_app}
    for group, name in _SERVER_COMMANDS:
        owner = groups[group]
        if any(c.name == name for c in owner.registered_commands):
            continue
        command = name if group is None else f"{group} {name}"
        owner.command(name, add_help_option=False,
                      context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
            _needs_server(command))


_load_plugins()


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
