"""What every ``tiered-emb`` command shares: its options, and the checks it makes before it touches anything.

- **Options**: counts in one syntax (``1M``, ``2K``, ``1.5G``: :func:`count`), ``--quiet``,
  ``--json`` and ``--version`` on every command (:func:`add_command`); an old spelling kept
  working, out of the help, where scripts may use it (:func:`add_alias`); every default
  shown in ``--help`` (:func:`show_defaults`).
- **Run directories**: a command replaces only what a run of the same command made in a
  directory it made itself, known by the file :data:`RUN_MARKER` written when it made it
  (:func:`check_run_dir`, then :func:`make_run_dir` once every flag has been checked); a
  file of the user's in there (a ``--data`` file, notes) stops it, with nothing removed.
- **Optional packages**: a run that needs one fails before it starts (:func:`require`).
- **Messages**: library messages go to the ``tiered_emb`` logger; :func:`log_to_stderr`
  shows them on standard error while a command runs (none but warnings with ``--quiet``).

Kept apart from :mod:`tiered_emb._args` (the store's per-call argument checks) because this
is the command line's concern alone, and the simulator's commands use it without the store.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from tiered_emb._args import parse_bytes, parse_count
from tiered_emb._version import __version__
from tiered_emb.errors import ConfigError, MissingExtraError, TieredEmbError

#: The file a command writes into a run directory it makes: only a directory holding it
#: (for the same command), or an empty one, is replaced by the next run.
RUN_MARKER = ".tiered-emb-run"

#: What a run of each command makes in its run directory, besides :data:`RUN_MARKER`: all
#: that a later run removes (anything else there is the user's).
RUN_ENTRIES = {
    "stream": frozenset({"stream.json", "store", "report.json"}),
    "train": frozenset({"config.json", "store", "report.json"}),
}

#: The JSON destination that means standard output (``--json`` with no file name).
STDOUT = "-"


def count(text: str) -> int:
    """An argparse ``type`` for counts: ``1M``, ``2K``, ``1.5G``, ``2_000`` or a plain int."""
    try:
        return parse_count(text)
    except TieredEmbError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def byte_size(text: str) -> int:
    """An argparse ``type`` for sizes in bytes: ``2GiB``, ``512MiB``, ``4M`` (:func:`tiered_emb._args.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except TieredEmbError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def reservation(text: str) -> tuple[str, int, int]:
    """An argparse ``type`` for a table's reserved bytes: ``NAME=HBM[:DDR]``, e.g. ``C3=16MiB:64MiB``."""
    name, eq, sizes = text.partition("=")
    hbm, _, ddr = sizes.partition(":")
    try:
        if not eq or not name or not hbm:
            raise argparse.ArgumentTypeError(f"{text!r} is not NAME=HBM[:DDR] (e.g. C3=16MiB:64MiB)")
        return name, parse_bytes(hbm), parse_bytes(ddr) if ddr else 0
    except TieredEmbError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_command(sub, name: str, help: str, description: str | None = None, json_file: bool = True):
    """The parser of subcommand ``name`` (``sub``: argparse's subparsers), with ``--json``,
    ``--quiet`` and ``--version``, the options every command takes.

    ``json_file``: ``--json`` also takes a file name (``--json out.json``); a command with
    positional arguments takes the bare flag only, so that ``--json PATH`` cannot take its
    positional argument for the file.
    """
    p = sub.add_parser(name, help=help, description=description or help)
    if json_file:
        p.add_argument(
            "--json",
            nargs="?",
            const=STDOUT,
            metavar="PATH",
            help="machine output: the results as JSON on stdout (nothing else there), or written to PATH",
        )
    else:
        p.add_argument(
            "--json", action="store_const", const=STDOUT, help="machine output: the results as JSON on stdout"
        )
    p.add_argument("--quiet", action="store_true", help="no progress bar, no messages but warnings and errors")
    p.add_argument("--version", action="version", version=f"tiered-emb {__version__}", help="print the version")
    return p


def add_alias(p: argparse.ArgumentParser, old: str, dest: str, **kwargs: object) -> None:
    """``old``, an earlier spelling of the option stored in ``dest``, still accepted but not
    shown in ``--help`` (scripts may use it)."""
    p.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def options(parser: argparse.ArgumentParser, command: str = "") -> Iterator[tuple[str, argparse.Action]]:
    """Every option of ``parser`` and of its subcommands, as ``(command, action)``; the
    command is the subcommands' names joined by spaces (``"bench mrc"``)."""
    # argparse keeps a parser's options in parser._actions and offers no public list of them
    for action in parser._actions:
        if isinstance(action.choices, dict):  # the subcommands: name -> parser
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}".strip())
        else:
            yield command, action


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Add ``(default: X)`` to the help of every option of ``parser`` (and its subcommands)
    that has a default and does not say it already; left out for flags and for ``None``,
    whose meaning the help text gives."""
    for _, action in options(parser):
        if not action.option_strings or not action.help or action.help == argparse.SUPPRESS:
            continue
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "(default" in action.help:
            continue
        action.help += " (default: %(default)s)"


def require(module: str, needed_by: str, hint: str) -> ModuleType:
    """``module`` imported, or a :class:`MissingExtraError` naming what needs it and ``hint``
    (the install command): checked before a run, so that it fails before doing any work."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(f"{needed_by} needs {module}, which cannot be imported ({err})", hint) from err


def check_run_dir(run_dir: Path, command: str, flag: str = "--run-dir") -> None:
    """A :class:`ConfigError`, with nothing changed, unless ``run_dir`` is absent, an empty
    directory, or a run directory that ``tiered-emb COMMAND`` made (it holds :data:`RUN_MARKER`
    naming the command)."""
    where = f"{flag} {str(run_dir)!r}"
    if not (run_dir.exists() or run_dir.is_symlink()):
        return
    if run_dir.is_symlink() or not run_dir.is_dir():
        raise ConfigError(f"{where} exists and is not a directory", f"choose another {flag} (a new run replaces it)")
    if not any(run_dir.iterdir()):
        return
    marker = run_dir / RUN_MARKER
    try:
        made_by = json.loads(marker.read_text(encoding="utf-8")).get("command")
    except (OSError, ValueError, AttributeError):  # absent, unreadable, not a JSON object
        made_by = None
    if made_by != command:
        if isinstance(made_by, str):
            what = f"holds a run of `tiered-emb {made_by}`, not of `tiered-emb {command}`"
        else:
            what = f"holds files but no run that `tiered-emb {command}` made (no {RUN_MARKER} file)"
        raise ConfigError(
            f"{where} {what}; nothing was removed", f"choose a new or empty {flag}, or remove that one yourself"
        )
    # (a run's directory may hold the user's files too, a --data file say: they are not the run's)
    others = sorted(
        p.name for p in run_dir.iterdir() if p.name != RUN_MARKER and p.name not in RUN_ENTRIES.get(command, ())
    )
    if others:
        raise ConfigError(
            f"{where} holds a run of `tiered-emb {command}` and files it did not make: "
            f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}; nothing was removed",
            f"move them out of {flag}, or choose a new or empty {flag}",
        )


def make_run_dir(run_dir: Path, command: str, flag: str = "--run-dir") -> None:
    """Make ``run_dir`` a new, empty run directory of ``command``: what an earlier run of it
    made there is removed (after :func:`check_run_dir` once more; the directory itself is
    kept, as an empty one the user made is), and :data:`RUN_MARKER` written."""
    check_run_dir(run_dir, command, flag)
    try:
        if run_dir.is_dir():
            for name in sorted(RUN_ENTRIES.get(command, ())):
                entry = run_dir / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                elif entry.exists() or entry.is_symlink():
                    entry.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_MARKER).write_text(
            json.dumps({"command": command, "tiered_emb": __version__}) + "\n", encoding="utf-8"
        )
    except OSError as err:
        raise ConfigError(
            f"{flag} {str(run_dir)!r} cannot be made ({err})", f"choose a {flag} under a directory you can write"
        ) from err


def print_json(payload: object) -> None:
    """``payload`` as JSON on standard output (``--json`` without a file name)."""
    sys.stdout.write(json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def log_to_stderr(quiet: bool) -> Iterator[None]:
    """Show the ``tiered_emb`` logger's messages on standard error while the block runs:
    information and up, or warnings and up when ``quiet``."""
    logger = logging.getLogger("tiered_emb")
    handler = logging.StreamHandler(sys.stderr)  # the stream of this instant: tests replace it
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
