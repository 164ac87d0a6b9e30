"""The ``hmi`` command line: argparse and printing only (nothing in the package imports it).

A module per command group: ``data``, ``roots`` (calibrate, plot, prepare, demo, info),
``serving`` (serve), ``tenants`` (infer, generate, tenant, jobs), ``domains``, ``private``, ``home`` and ``bundle``;
each builds its commands' arguments (``arguments(command, parser)``) and runs them.  ``main``
imports only the group of the command it runs, so ``hmi --help`` and the client commands start in
a fraction of a second, and the model side (torch, transformers, the PLOT) is loaded by the
commands that use it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hmi.allocator import tune_allocator
from hmi.bootstrap import offline, prepare_data_in_background
from hmi.model.aliases import RootError

# command -> (the module of its group, its one-line help)
COMMANDS = {
    "data": ("data", "real datasets and domain corpora"),
    "calibrate": ("roots", "distill the windowed lower layers from the full root"),
    "plot": ("roots", "PLOT lookup tables"),
    "prepare": ("roots", "data, calibrated root, root PLOT and the learned back-off auto serves (or --decoder's), each only when missing"),
    "demo": ("roots", "set up the embedded default and encode held-out texts through it"),
    "serve": ("serving", "run the HTTP server (prepares the embedded default when missing)"),
    "generate": ("tenants", "generate text with a decoder tenant (streams as it comes)"),
    "infer": ("tenants", "run a tenant's model on texts (through the server)"),
    "tenant": ("tenants", "tenant hPLMs on a server"),
    "jobs": ("tenants", "list jobs, or cancel one"),
    "domain": ("domains", "the version tree of domains (in HMI_HOME, or on a server with --url)"),
    "private": ("private", "a private tenant: its adapter here, the root's frozen layers on the server"),
    "info": ("roots", "home directory, root artifact and its quality figures"),
    "backup": ("home", "a consistent copy of the home, also while a server runs"),
    "restore": ("home", "check a backup and make it the home"),
    "bundle": ("bundle", "files for a machine that reaches no registry, in pieces checked by sha256"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with ``only`` of that command alone (the others are listed
    with their help, without their arguments)."""
    p = argparse.ArgumentParser(prog="hmi", description="HMI: hierarchical multi-tenant inference server")
    sub = p.add_subparsers(dest="command", required=True)
    for command, (group, summary) in COMMANDS.items():
        parser = sub.add_parser(command, help=summary)
        if only is None or command == only:
            importlib.import_module(f"hmi.cli.{group}").arguments(command, parser)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    offline()  # before any group imports the model side
    command = next((a for a in argv if not a.startswith("-")), None)
    # A first `hmi serve` prepares the data while it imports the server (on a first start also
    # compiling torch's modules): seconds each, side by side. Whatever needs the data waits for it.
    data = prepare_data_in_background() if command == "serve" and not {"-h", "--help"} & set(argv) else None
    try:
        args = build_parser(command if command in COMMANDS else "").parse_args(argv)
        tune_allocator()
        return args.func(args)
    except RootError as exc:  # an unknown root, a failed fetch, a checkpoint HMI cannot split
        print(f"hmi: {exc}", file=sys.stderr)
        return 2
    finally:
        if data is not None and data.is_alive():
            data.terminate()  # the command ended before it needed the data (its files are written atomically)


if __name__ == "__main__":
    sys.exit(main())
