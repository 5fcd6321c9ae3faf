"""`monoserve` command line: wires each area's subcommands into one argparse parser.

Each area registers its own subcommands in its own module (`register(subparsers)`), so this
file stays a switchboard. A module that fails to import (e.g. a missing optional dependency)
does not take the other subcommands down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> registers subcommands; order is the order shown in --help
COMMAND_MODULES = (
    "replicas.cli_cmds",  # make-checkpoint, generate (local), replica
    "replicas.cli_replica",  # replica (skipped if replicas.cli_cmds already registered it)
    "router.cli_cmds",  # router, generate --router
    "cluster.cli_cmds",  # demo, up, down, status, bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monoserve", description="Fast single-request LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # area not written yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
