"""``podbay run-code ID CODE|-``: run code in a sandbox's code interpreter and show its results in a terminal.

Printed output streams as the code prints it (stdout to stdout, stderr to stderr). Rich results are shown as a
terminal can: text as is, JSON on one line, Markdown and LaTeX as their source; images (PNG, JPEG, SVG), PDFs and
HTML are written to files in ``--out-dir`` and the path is printed (HTML with a one-line summary of its text).
An error in the code prints its traceback on stderr and exits 1 (124 for a timeout).
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
from pathlib import Path

import typer

from podbay.cli._common import client, fail, handle_errors, parse_pairs
from podbay.cli.exec_cmd import TIMED_OUT_STATUS, _write
from podbay.sdk._code import CodeError, CodeResult

__all__ = ["render_error", "render_result", "run_code_command"]

#: Result fields written to files: field -> (extension, base64-encoded?).
_FILES = {"png": ("png", True), "jpeg": ("jpg", True), "pdf": ("pdf", True), "svg": ("svg", False),
          "html": ("html", False)}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"<[^>]*>")
#: Characters of an HTML result's text shown in its summary line.
_SUMMARY_CHARS = 80


def _html_summary(markup: str) -> str:
    """The text of ``markup`` (tags dropped, entities decoded, whitespace folded), cut at 80 characters."""
    text = " ".join(html.unescape(_TAG.sub(" ", markup)).split())
    return text if len(text) <= _SUMMARY_CHARS else text[:_SUMMARY_CHARS - 1] + "…"


def render_result(result: CodeResult, out_dir: Path, stem: str) -> list[str]:
    """The lines that show ``result`` in a terminal; files it needs are written as ``out_dir/stem.<ext>``.

    Text first (a result with a text form, e.g. a pandas frame with text and HTML, shows its text and still
    saves the HTML); then JSON compact, Markdown and LaTeX source; then one ``[<kind> saved to <path> (<n>
    bytes)]`` line per file; an HTML result without text adds its summary. Other MIME types are named.
    """
    lines: list[str] = []
    if result.text is not None:
        lines.append(result.text)
    if result.json_value is not None:
        lines.append(json.dumps(result.json_value, separators=(",", ":")))
    for name in ("markdown", "latex"):
        value = getattr(result, name)
        if value and result.text is None:
            lines.append(value)
    for field, (ext, is_b64) in _FILES.items():
        value = getattr(result, field)
        if not value:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stem}.{ext}"
        data = base64.b64decode(value) if is_b64 else value.encode("utf-8")
        path.write_bytes(data)
        note = f"[{field} saved to {path} ({len(data)} bytes)"
        if field == "html" and result.text is None:
            note += f": {_html_summary(value)}"
        lines.append(note + "]")
    if result.javascript:
        lines.append(f"[javascript, {len(result.javascript)} characters, not run]")
    for name in ("data", "chart"):
        if getattr(result, name):
            lines.append(f"[{name}: " + json.dumps(getattr(result, name), separators=(",", ":"))[:200] + "]")
    lines += [f"[{mime}]" for mime in (result.extra or {})]
    return lines


def render_error(error: CodeError, colour: bool) -> str:
    """The traceback as the kernel formatted it (ANSI colours kept only for a terminal), else ``name: value``."""
    text = error.traceback or f"{error.name}: {error.value}"
    return text if colour else _ANSI.sub("", text)


@handle_errors
def run_code_command(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID", help="Sandbox id (of the code-interpreter template)."),
    code: str = typer.Argument(..., metavar="CODE|-", help="The code; - reads it from stdin."),
    language: str | None = typer.Option(None, "--language", "-l", help="python (default) or bash."),
    context: str | None = typer.Option(None, "--context", help="A context id (instead of --language)."),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for this run only; repeatable."),
    timeout: float | None = typer.Option(None, "--timeout", help="Interrupt the code after this many seconds."),
    out_dir: Path = typer.Option(Path("."), "--out-dir", help="Where images, PDFs and HTML results are saved."),
) -> None:
    """Run code in a sandbox's code interpreter, streaming what it prints and showing its results.

    Images, PDFs and HTML are saved as files (result-<execution count>-<n>.<ext> in --out-dir) and their paths
    printed. Exit status: 0, 1 when the code raised (its traceback on stderr), 124 when it timed out.
    """
    if code == "-":
        code = sys.stdin.read()
    if language and context:
        fail("give --language or --context, not both", "usage", 2)
    execution = client(ctx).run_code(sandbox_id, code, language=language, context=context,
                                     env=parse_pairs(env, "--env"), timeout=timeout,
                                     on_stdout=lambda t: _write(sys.stdout, t),
                                     on_stderr=lambda t: _write(sys.stderr, t))
    count = execution.execution_count if execution.execution_count is not None else 0
    for n, result in enumerate(execution.results, 1):
        for line in render_result(result, out_dir, f"result-{count}-{n}"):
            _write(sys.stdout, line + "\n")
    if execution.error is not None:
        _write(sys.stderr, render_error(execution.error, sys.stderr.isatty()) + "\n")
        raise typer.Exit(TIMED_OUT_STATUS if execution.error.name == "TimeoutError" else 1)
