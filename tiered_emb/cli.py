"""``tiered-emb`` command: one argparse subcommand per job; each module adds its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys

from tiered_emb._version import __version__
from tiered_emb.errors import TieredEmbError

# module path of each subcommand; each module has ``add_parser(subparsers)``.
_COMMANDS = [
    "tiered_emb.apps.stream",
    "tiered_emb.apps.dlrm",
    "tiered_emb.apps.portable",
    "tiered_emb.apps.inspect",
    "tiered_emb.sim.cli",
]


def main(argv=None) -> int:
    """Run a subcommand.  From the shell (``argv`` None) a :class:`TieredEmbError` is printed
    as ``error: ... (hint: ...)`` with exit status 2; called with ``argv`` it is raised."""
    parser = argparse.ArgumentParser(prog="tiered-emb", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"tiered-emb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in _COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    args = parser.parse_args(argv)
    if argv is not None:
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except TieredEmbError as err:
        print(f"tiered-emb {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
