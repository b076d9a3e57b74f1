"""`planner` command line: a registry of thin commands.

Each command: parse -> load specs -> call one library function -> write files. Library code
raises PlannerError; `main` turns it into one line on stderr and exit status 2, so bad input
never ends in a traceback. Commands are imported lazily so `planner estimate` never pays for
torch or deepspeed.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from planner.errors import PlannerError

# command name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "search": "planner.cli.search:search",
    "estimate": "planner.cli.estimate:estimate",
    "run": "planner.cli.run:run",
    "verify": "planner.cli.run:verify",
    "ladder": "planner.cli.ladder:ladder",
    "profile": "planner.cli.profile:profile",
    "calibrate": "planner.cli.profile:calibrate",
    "report": "planner.cli.report:report",
    "export": "planner.cli.export:export",
    "prepare-data": "planner.cli.data:prepare_data",
    "serve": "planner.cli.serve:serve",
    "serve-bench": "planner.cli.serve_bench:serve_bench",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(n for n, t in COMMANDS.items() if importlib.util.find_spec(t.split(":")[0]))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="planner")
def cli() -> None:
    """Plan, run and explain DeepSpeed training of GLM-family models."""


def main(argv: list[str] | None = None) -> int:
    """Entry point: one line and a non-zero exit for any user error; a bare `planner` prints
    its usage (exit 0), not a usage error squashed into one line."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        with click.Context(cli, info_name="planner") as ctx:
            click.echo(cli.get_help(ctx))
        return 0
    try:
        cli.main(args=args, prog_name="planner", standalone_mode=False)
    except PlannerError as exc:
        click.echo(f"error: {exc.line()}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        # usage errors: one line naming the option, as click words it
        msg = exc.format_message().replace("\n", " ")
        ctx_cmd = getattr(getattr(exc, "ctx", None), "command_path", "planner")
        click.echo(f"error: {msg} (see `{ctx_cmd} --help`)", err=True)
        return exc.exit_code if exc.exit_code else 2
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130
    except Exception as exc:  # a bug, not bad input: still one line unless asked for more
        if os.environ.get("PLANNER_DEBUG"):
            raise
        click.echo(f"error: internal error {type(exc).__name__}: {exc} "
                   "(set PLANNER_DEBUG=1 for a traceback and report it)", err=True)
        return 3
    return 0


def entry() -> None:
    sys.exit(main())
