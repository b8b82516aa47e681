"""The ``tiered-emb`` command line as a whole: the options every command shares, the run
directories it refuses to remove, the packages it needs checked before a run, machine output,
progress and messages (issue 22, "One CLI")."""

import io
import json
import logging
import sys
from argparse import SUPPRESS

import numpy as np
import pytest

from tiered_emb import __version__
from tiered_emb._options import RUN_MARKER, check_run_dir, make_run_dir, options
from tiered_emb._progress import progress_bar
from tiered_emb.cli import EXIT_ERROR, build_parser, main
from tiered_emb.errors import ConfigError, MissingExtraError

# every command, as typed after `tiered-emb`
COMMANDS = [
    ["stream"],
    ["train"],
    ["export"],
    ["import"],
    ["verify"],
    ["inspect"],
    ["bench", "policies"],
    ["bench", "mrc"],
    ["bench", "lookahead"],
]
# the earlier spellings kept working (out of the help), and the option each one is
ALIASES = {"--ids": "rows", "--no-progress": "quiet"}
STREAM = ["--tables", "1", "--rows", "1000", "--batch", "64", "--hbm-rows", "16", "--ddr-rows", "16", "--steps", "1"]
BENCH = ["--rows", "1k", "--requests", "5k", "--cache", "20%", "--repeats", "1", "--quiet"]


def _shell(monkeypatch, *argv):
    """``tiered-emb ARGV`` as the shell runs it (errors printed, an exit status returned), in this process."""
    monkeypatch.setattr(sys, "argv", ["tiered-emb", *argv])
    return main()


# ----------------------------------------------------------------------------------------- options
def test_every_option_of_every_command_is_documented_with_its_default():
    """`stream --help` documented 2 of its 11 flags; every option now has a help text, and
    every default is shown."""
    parser = build_parser()
    seen_commands = set()
    undocumented, no_default = [], []
    for command, action in options(parser):
        seen_commands.add(command)
        if action.help == SUPPRESS:
            assert set(action.option_strings) <= set(ALIASES), (command, action.option_strings)
            continue
        if not action.help or not action.help.strip():
            undocumented.append((command, action.option_strings or action.dest))
        has_default = action.default is not None and action.default is not False and action.default != SUPPRESS
        if action.option_strings and has_default and "default" not in action.help:
            no_default.append((command, action.option_strings))
    assert {" ".join(c) for c in COMMANDS} <= seen_commands
    assert undocumented == [] and no_default == []
    for command in COMMANDS:  # and the rendered help says them
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--help"])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_the_shared_options(command, capsys):
    flags = {s for c, a in options(build_parser()) if c == " ".join(command) for s in a.option_strings}
    assert {"--json", "--quiet", "--version", "--help"} <= flags
    with pytest.raises(SystemExit) as e:
        main([*command, "--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tiered-emb {__version__}"


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["stream", "--rows", "1M"], "rows", 1_000_000),
        (["stream", "--ids", "1M"], "rows", 1_000_000),  # rejected before: `--ids` was type=int
        (["stream", "--batch", "2K", "--steps", "1.5K"], "steps", 1500),
        (["train", "--rows", "1M"], "rows", 1_000_000),  # rejected before
        (["train", "--batch", "4K"], "batch", 4000),
        (["import", "x", "y", "--budget-bytes", "256M"], "budget_bytes", 256_000_000),
        (["bench", "policies", "--rows", "1.5G"], "rows", 1_500_000_000),
        (["bench", "mrc", "--ids", "10M"], "rows", 10_000_000),
        (["bench", "lookahead", "--step-requests", "2K"], "step_requests", 2000),
        (["bench", "mrc", "--no-progress"], "quiet", True),
    ],
)
def test_counts_in_one_syntax_and_old_spellings_everywhere(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_a_count_that_is_not_one_is_a_usage_error(capsys):
    for bad in ("lots", "1.5", "1.0001K", "1e30"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["stream", "--rows", bad])
        assert e.value.code == 2
        assert "not a count" in capsys.readouterr().err


def test_the_defaults_of_a_command_are_those_it_documents():
    args = build_parser().parse_args(["bench", "policies"])
    assert (args.rows, args.requests, args.drift_period, args.quiet, args.json) == (
        1_000_000,
        None,
        1_000_000,
        False,
        None,
    )
    args = build_parser().parse_args(["stream"])
    assert (args.rows, args.batch, args.quiet, args.json) == (2_000_000, 8192, False, None)


# ------------------------------------------------------------------------------- run directories
def test_a_directory_the_command_did_not_make_is_never_removed(tmp_path):
    """`stream --run-dir precious` removed the user's directory; `train` removed any holding a
    config.json.  Only a directory a run of the same command made (its marker) is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # a user's file that train's old check took for a run
    (mine / "notes.txt").write_text("keep")
    for command in ("stream", "train"):
        with pytest.raises(ConfigError, match="nothing was removed") as e:
            check_run_dir(mine, command)
        assert "remove that one yourself" in e.value.hint
    make_run_dir(tmp_path / "run", "stream")
    with pytest.raises(ConfigError, match="holds a run of `tiered-emb stream`, not of `tiered-emb train`"):
        make_run_dir(tmp_path / "run", "train")
    (tmp_path / "run" / "report.json").write_text("of the run")
    make_run_dir(tmp_path / "run", "stream")  # its own: replaced
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [RUN_MARKER]
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "run")
    with pytest.raises(ConfigError, match="not a directory"):
        check_run_dir(link, "stream")


def test_a_run_dir_keeps_what_its_runs_did_not_make(tmp_path):
    """A run directory of `train` holding the user's data (`--data run/day0.tsv`) lost it to
    the next run: the whole directory was removed.  Only what a run makes is replaced; an
    empty directory is used as it is (not removed and made again)."""
    run = tmp_path / "run"
    make_run_dir(run, "train")
    (run / "config.json").write_text("{}")
    (run / "store").mkdir()
    (run / "store" / "data.mdb").write_text("of the run")
    (run / "day0.tsv").write_text("the user's data")
    with pytest.raises(ConfigError, match=r"day0\.tsv.*nothing was removed"):
        make_run_dir(run, "train")
    assert (run / "day0.tsv").read_text() == "the user's data" and (run / "store" / "data.mdb").exists()
    (run / "day0.tsv").unlink()
    make_run_dir(run, "train")
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    make_run_dir(empty, "stream")
    assert empty.stat().st_ino == inode and sorted(p.name for p in empty.iterdir()) == [RUN_MARKER]


def test_stream_refuses_before_anything_else(tmp_path, monkeypatch, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    assert _shell(monkeypatch, "stream", "--run-dir", str(precious), *STREAM, "--policy", "foo") == EXIT_ERROR
    err = capsys.readouterr().err
    assert "nothing was removed" in err and "Traceback" not in err
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "fresh"
    for bad in (
        ["--policy", "foo"],
        ["--tables", "0"],
        ["--batch", "0"],
        ["--alpha", "nan"],
        ["--json", str(tmp_path)],
    ):
        with pytest.raises(ConfigError):
            main(["stream", "--run-dir", str(fresh), *STREAM, *bad])
        assert not fresh.exists(), bad


def test_train_checks_its_run_dir_first_and_torch_before_the_run(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ImportError
    with pytest.raises(ConfigError, match="no run that `tiered-emb train` made"):
        main(["train", "--run-dir", str(mine)])
    assert (mine / "config.json").read_text() == '{"my": "settings"}'
    with pytest.raises(MissingExtraError, match="tiered-emb train needs torch") as e:
        main(["train", "--run-dir", str(tmp_path / "new")])
    assert "pip install" in e.value.hint and not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------ optional packages
@pytest.mark.parametrize(
    "package, extra",
    [("matplotlib", ["--plot", "{tmp}/x.png"]), ("libcachesim", ["--compare", "libcachesim"])],
)
def test_a_missing_package_fails_the_run_before_it_starts(package, extra, tmp_path, monkeypatch, capsys):
    """A missing matplotlib was reported after the whole run, with exit status 0."""
    monkeypatch.setitem(sys.modules, package, None)
    extra = [x.format(tmp=tmp_path) for x in extra]
    status = _shell(monkeypatch, "bench", "policies", *BENCH, "--policies", "lru", *extra)
    out, err = capsys.readouterr()
    assert status == EXIT_ERROR and out == ""  # no table: nothing ran
    assert f"needs {package}" in err and "pip install" in err
    assert not (tmp_path / "x.png").exists()


def test_lookahead_draws_the_plot_it_is_asked_for(tmp_path):
    """`bench lookahead --plot` took the flag and drew nothing."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "la.png"
    assert main(["bench", "lookahead", *BENCH, "--step-requests", "64", "--window", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- machine output
@pytest.mark.parametrize(
    "command", [["policies", "--policies", "lru,belady"], ["mrc"], ["lookahead", "--step-requests", "64"]], ids=str
)
def test_json_alone_on_stdout(command, capsys):
    assert main(["bench", command[0], *BENCH, *command[1:], "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["command"] == command[0] and payload["requests"] == 5000


def test_stream_and_store_commands_print_json(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["stream", "--run-dir", str(run), *STREAM, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 1 and report == json.loads((run / "report.json").read_text())
    assert main(["inspect", str(run / "store"), "--json"]) == 0
    assert "t0" in json.loads(capsys.readouterr().out)["tables"]
    assert main(["export", str(run / "store"), str(tmp_path / "x"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exported"]["t0"] > 0
    assert main(["export", str(run / "store"), str(tmp_path / "y")]) == 0
    assert capsys.readouterr().out.startswith("exported 1 tables")


def test_a_trace_file_is_simulated_whole_by_default(tmp_path, capsys):
    """`--trace npy:FILE` simulated only its first 2,000,000 requests unless --requests said otherwise."""
    n = 2_000_003
    np.save(tmp_path / "t.npy", np.arange(n, dtype=np.int64) % 1000)
    common = ["bench", "policies", "--trace", f"npy:{tmp_path / 't.npy'}", "--cache", "10", "--policies", "lru"]
    assert main([*common, "--repeats", "1", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == n
    assert main([*common, "--repeats", "1", "--quiet", "--json", "--requests", "1k"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["requests"] == 1000 and "first 1,000 requests" in capped["description"]


# ------------------------------------------------------------------------------ progress, messages
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_drawn_on_a_terminal_only():
    for stream, quiet, drawn in ((io.StringIO(), False, False), (_Terminal(), True, False), (_Terminal(), False, True)):
        with progress_bar(3, "steps", quiet=quiet, stream=stream) as bar:
            bar.update(3)
        assert bool(stream.getvalue()) == drawn
        if drawn:
            assert "3/3" in stream.getvalue()


def test_library_messages_go_through_logging(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="tiered_emb"):
        assert main(["bench", "mrc", *BENCH[:-1], "--no-opt"]) == 0
    assert any(r.name.startswith("tiered_emb.") and r.getMessage().startswith("trace: ") for r in caplog.records)
    assert "trace: " in capsys.readouterr().err
    assert main(["bench", "mrc", *BENCH, "--no-opt"]) == 0  # --quiet: information is not shown
    assert "trace: " not in capsys.readouterr().err
    handlers = logging.getLogger("tiered_emb").handlers
    assert [h for h in handlers if not isinstance(h, logging.NullHandler)] == []  # the command's is gone after it
