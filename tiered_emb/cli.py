"""``tiered-emb`` command: one argparse subcommand per job; each module adds its own parser.

Every command takes the options of :func:`tiered_emb._options.add_command` (``--json``,
``--quiet``, ``--version``), writes counts as ``1M`` / ``2K`` / ``1.5G``, and shows every
default in its ``--help``.  Exit status: 0 done; 1 done, and what it checked is not right
(``verify`` found damage); 2 refused (a bad flag, a run directory that is not the command's
own, a missing optional package: before any work) or failed with a typed error; 130
interrupted.  docs/cli.md has the commands and their options.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tiered_emb._options import log_to_stderr, show_defaults
from tiered_emb._version import __version__
from tiered_emb.errors import TieredEmbError

# module path of each subcommand; each module has ``add_parser(subparsers)``.
_COMMANDS = [
    "tiered_emb.apps.stream",
    "tiered_emb.apps.dlrm",
    "tiered_emb.apps.portable",
    "tiered_emb.apps.lifecycle",
    "tiered_emb.apps.inspect",
    "tiered_emb.sim.cli",
]

#: Exit statuses (docs/cli.md).
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand, its options, their defaults in the help."""
    parser = argparse.ArgumentParser(prog="tiered-emb", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"tiered-emb {__version__}", help="print the version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in _COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    show_defaults(parser)
    return parser


def main(argv=None) -> int:
    """Run a subcommand.  From the shell (``argv`` None) a :class:`TieredEmbError` is printed
    as ``error: ... (hint: ...)`` with exit status 2; called with ``argv`` it is raised."""
    args = build_parser().parse_args(argv)
    command = " ".join(c for c in (args.command, getattr(args, "bench_command", None)) if c)
    with log_to_stderr(getattr(args, "quiet", False)):
        if argv is not None:
            return int(args.func(args) or 0)
        try:
            return int(args.func(args) or 0)
        except TieredEmbError as err:
            print(f"tiered-emb {command}: error: {err}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print(f"tiered-emb {command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
