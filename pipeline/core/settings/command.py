"""The `python -m pipeline.core.params` command (typer): set keys of the params file in place, print one value,
check the file or a profile, print the `dvc exp run` arguments of a profile, write or check the JSON schema."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import click
import typer

from pipeline.core.settings.params_file import read_params, set_values
from pipeline.core.settings.profiles import differences_from_defaults, flatten, profile_overrides, read_profile
from pipeline.core.settings.root import Params, json_schema
from pipeline.core.settings.validation import ParamsError, validate

SCHEMA_PATH = Path("docs/params.schema.json")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Edit, read and check params files and profiles; publish their JSON schema.")


@app.callback()
def options(ctx: typer.Context,
            params: Annotated[Path, typer.Option(help="the params file")] = Path("params.yaml")) -> None:
    ctx.obj = params


def _load(path: Path) -> Params:
    return validate(Params, read_params(path))


@app.command("set")
def set_keys(ctx: typer.Context,
             assignments: Annotated[list[str], typer.Argument(metavar="KEY=VALUE...", help="dotted.key=yaml")]) -> None:
    """Set keys in place, keeping the file's comments; the file is left as it was unless the result is valid."""
    pairs: list[tuple[str, str]] = []
    for assignment in assignments:
        key, eq, value = assignment.partition("=")
        if not eq:
            raise ParamsError(f"expected dotted.key=value, got {assignment!r}")
        pairs.append((key, value))
    if not ctx.obj.is_file():
        raise ParamsError(f"params file not found: {ctx.obj}")
    set_values(ctx.obj, pairs, check=_load)  # all or none, validated as a whole before the file is replaced
    for assignment in assignments:
        print(f"{ctx.obj}: {assignment.replace('=', ' = ', 1)}")


@app.command()
def get(ctx: typer.Context, key: Annotated[str, typer.Argument(help="dotted.key")]) -> None:
    """Print one key's value from the validated params (defaults fill keys the file leaves out)."""
    values = flatten(dataclasses.asdict(_load(ctx.obj)))
    if key not in values:
        raise ParamsError(f"unknown key {key}")
    print(values[key])


@app.command()
def check(ctx: typer.Context,
          profile: Annotated[Path | None, typer.Option(help="also check this profile")] = None) -> None:
    """Validate the params file (and a profile merged over the defaults)."""
    _load(ctx.obj)
    if profile is not None:
        read_profile(profile)
    print(f"{ctx.obj}{f' and {profile}' if profile else ''}: valid")


@app.command()
def overrides(ctx: typer.Context, profile: Annotated[Path, typer.Argument(help="profiles/NAME.yaml")]) -> None:
    """Print the `dvc exp run` arguments that apply a profile (after checking it). DVC composes the profile over the
    params file as it is; where that file is no longer the defaults (a previous `dvc exp run`, which rewrites it,
    or an edit), the keys that differ are named on stderr, since the profile's run then keeps them."""
    args = profile_overrides(profile)
    if ctx.obj.is_file():
        differ = differences_from_defaults(dataclasses.asdict(_load(ctx.obj)), dataclasses.asdict(Params()))
        if differ:
            listed = "; ".join(f"{k}={v!r} (default {d!r})" for k, (v, d) in list(differ.items())[:8])
            more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
            print(f"note: {ctx.obj} differs from the defaults in {listed}{more}; {profile} is applied over these "
                  f"(`git checkout {ctx.obj}` returns to the defaults first)", file=sys.stderr)
    print(shlex.join(args))


@app.command()
def schema(out: Annotated[Path, typer.Option(help="where the schema goes")] = SCHEMA_PATH,
           check_only: Annotated[bool, typer.Option("--check", help="only fail if `out` is stale")] = False) -> None:
    """Write the JSON schema of params files (editors validate params.yaml and profiles with it)."""
    text = json.dumps(json_schema(), indent=2) + "\n"
    if check_only:
        if not out.is_file() or out.read_text() != text:
            raise ParamsError(f"{out} is stale: run python -m pipeline.core.params schema")
        return
    from pipeline.core.io import replaced_on_success

    with replaced_on_success(out) as tmp:  # an editor reading it mid-write sees the old schema or the new one
        tmp.write_text(text)
    print(f"wrote {out}")


def run(argv: list[str] | None = None) -> None:
    """Run the command on `argv` (default: the process's arguments). Errors print one line and exit 2."""
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="python -m pipeline.core.params", standalone_mode=False)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
