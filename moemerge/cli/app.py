"""The Typer app, its consoles and the one place errors become exit codes.

Exit codes scripts can rely on: 0 success, 1 runtime error (bad or missing checkpoint, mismatch
between models, failed output check), 2 recipe or usage error, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM).
"""

from __future__ import annotations

import inspect
import re
import signal
import threading
import warnings
from collections.abc import Callable
from functools import partial, wraps
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from moemerge import __version__
from moemerge.errors import MoemergeError, Note, RecipeError, Terminated


def clickish(command) -> None:
    """Make a command's help read as Click's does, whatever Typer version renders it: usage
    `RECIPE [OUTPUT]`, a value option's type in upper case (`--seq-len INTEGER`), no type on a
    flag or an argument (newer Typer shows `<bool>`, `<str>`, `{recipe}`), paragraphs
    that reflow (a docstring's line breaks inside a paragraph are spaces), and help texts that
    are plain text: Typer's rich mode reads them as markup, where `the [gguf] extra` would
    lose `[gguf]` as an unknown tag, so they are escaped for it."""
    plain = _plain_text(getattr(command, "rich_markup_mode", None))
    if command.help:
        command.help = plain(re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(command.help)))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = plain(param.help)
        if not hasattr(param, "display_type_rich"):  # older Typer: Click's rendering
            continue
        label = None
        if param.param_type_name == "argument":
            param.metavar = param.metavar or param.name.upper()
            param._usage_display_name = partial(_usage_name, param)
        elif not (param.is_flag or param.count):
            bare = re.sub(r"^list\[(.*)\]$", r"\1", param.bare_type())
            label = param.metavar or TYPE_LABELS.get(bare, bare.upper())
        param.display_type_rich = lambda ctx, label=label: label


def _plain_text(markup_mode) -> Callable[[str], str]:
    """How a help text is kept plain under `markup_mode`: escaped for rich markup, as it is
    otherwise (Click's and Typer's non-rich renderings print it verbatim)."""
    return escape if markup_mode == "rich" else str


TYPE_LABELS = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "Path": "PATH"}  # Click's


def _usage_name(param) -> str:
    name = param.metavar if param.required else f"[{param.metavar}]"
    return name + ("..." if param.nargs != 1 else "")


def _help_option(option):
    if option is not None and hasattr(option, "display_type_rich"):
        option.display_type_rich = lambda ctx: None
    return option


class _Clickish:
    """Help as Click's (`clickish`), mixed into Typer's command and group classes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        clickish(self)

    def get_help_option(self, ctx):
        return _help_option(super().get_help_option(ctx))


class Command(_Clickish, TyperCommand):
    """Every moemerge command."""


class Group(_Clickish, TyperGroup):
    """The `moemerge` group."""


class App(typer.Typer):
    """moemerge's Typer app: every command is a `Command`."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)


app = App(
    cls=Group,
    name="moemerge",
    help="Turn dense expert LLM checkpoints into Mixture-of-Experts models.\n\n"
    "Start with `moemerge demo`: it makes tiny experts offline, builds an MoE from them and "
    "prints per-domain perplexities.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def reports_errors(command: Callable) -> Callable:
    """Turn moemerge's own errors into one red paragraph and the error's exit code; SIGTERM
    is handled like Ctrl-C (the temporary output is removed), exit code 143."""

    @wraps(command)
    def run(*args, **kwargs):
        previous = _on_sigterm(_terminate)
        shown = warnings.showwarning
        warnings.showwarning = partial(_show_note, shown)
        try:
            return command(*args, **kwargs)
        except MoemergeError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            err.print("[yellow]interrupted; no output was left behind[/]")
            raise typer.Exit(143 if isinstance(exc, Terminated) else 130) from None
        except OSError as exc:  # the machine's own refusal (permissions, a full disk, ...)
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        finally:
            _on_sigterm(previous)
            warnings.showwarning = shown

    return run


def described(model: type, name: str, *decls: str, more: str = "", **extra):
    """The typer option of field `name` of pydantic model `model` (the command's options: the
    recipe or options model it fills), its help the field's description (+ `more`)."""
    info = model.__pydantic_fields__[name]
    return typer.Option(*decls, help=info.description + more, **extra)


def defaults(model: type) -> dict:
    """{field: default} of a pydantic model: the options' defaults, as the model has them."""
    return {name: info.default for name, info in model.__pydantic_fields__.items()}


def at_most(option: str, value: int, bound: int, what: str) -> None:
    """A length or count option past its bound (moemerge/bounds.py) is a usage error naming
    the bound, before any work."""
    if value > bound:
        raise RecipeError(f"{option}: {value:,} {what}; at most {bound:,}")


def _show_note(otherwise, message, category, *args, **kwargs) -> None:
    """moemerge's Notes as `note: ...` lines on stderr; other warnings as Python shows them."""
    if issubclass(category, Note):
        err.print(f"[cyan]note:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        otherwise(message, category, *args, **kwargs)


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup must not be cut short
    raise Terminated()


def _on_sigterm(handler):
    """Install `handler` for SIGTERM (main thread only); return the previous one."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _version(value: bool) -> None:
    if value:
        out.print(f"moemerge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Turn dense expert LLM checkpoints into Mixture-of-Experts models."""
