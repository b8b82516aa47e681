"""The DLRM main job at tiny size: the smoke run, resume bitwise, a real Criteo sample."""

import io
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiered_emb import TableConfig, TieredStore  # noqa: E402
from tiered_emb.apps.clicks import CRITEO_KAGGLE_ROWS, SyntheticClicks, table_rows  # noqa: E402
from tiered_emb.apps.dlrm import auc, log_loss  # noqa: E402
from tiered_emb.apps.dlrm_config import default_rows, distinct_ids, run_tiers  # noqa: E402
from tiered_emb.cli import main  # noqa: E402
from tiered_emb.prefetch.window import pin_budget  # noqa: E402

TINY = [
    "--batch",
    "64",
    "--rows",
    "3000",
    "--dim",
    "4",
    "--hbm-rows",
    "128",
    "--ddr-rows",
    "128",
    "--bottom",
    "8",
    "--top",
    "8",
    "--eval-batches",
    "2",
    "--quiet",
]
CRITEO_SAMPLE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "criteo_sample_900.tsv"


def _train(run_dir, *extra):
    assert main(["train", "--run-dir", str(run_dir), *TINY, *extra]) == 0
    return json.loads((run_dir / "report.json").read_text())


def _state(run_dir):
    """Every row with its optimizer state, and the dense weights, of a finished run."""
    with TieredStore.open(run_dir / "store", restore="checkpoint") as store:
        ids = np.arange(3000)
        rows = {name: store.peek(name, ids, with_state=True).tobytes() for name in store.tables}
        saved = torch.load(io.BytesIO(store.extra), weights_only=True)
    return rows, saved


def _epoch(run_dir):
    """How many checkpoints the run's store has taken (read before close() takes one more)."""
    with TieredStore.open(run_dir / "store", restore="checkpoint") as store:
        return store.epoch


def _assert_same_model(model_a, model_b):
    """MLP weights bit for bit; the tables' references (store path, checkpoint count) name the same tables."""
    assert model_a.keys() == model_b.keys()
    for k, v in model_a.items():
        if k.endswith("_extra_state"):
            assert v["table"] == model_b[k]["table"], k
        else:
            assert torch.equal(v, model_b[k]), k


def _assert_bitwise_equal(state_a, state_b):
    """Two :func:`_state` results are equal bit for bit: rows, step, MLP weights, optimizer state."""
    rows_a, saved_a = state_a
    rows_b, saved_b = state_b
    assert saved_a["step"] == saved_b["step"]
    assert [n for n in rows_a if rows_a[n] != rows_b[n]] == []
    _assert_same_model(saved_a["model"], saved_b["model"])
    for k, v in saved_a["opt"]["state"].items():
        assert all(torch.equal(t, saved_b["opt"]["state"][k][n]) for n, t in v.items()), k


def test_smoke_run_reports(tmp_path, capsys):
    r = _train(tmp_path / "run", "--steps", "6")
    out = capsys.readouterr().out
    assert "held-out log loss" in out and "AUC" in out and "hbm" in out
    assert r["steps"] == 6 and r["samples_per_s"] > 0
    if sys.platform.startswith("linux"):  # per-thread CPU from /proc
        cpu = r["thread_cpu_ms_per_step"]
        assert cpu["main"] > 0 and "tiered_emb-prefetch" in cpu and "writer process" in cpu and min(cpu.values()) >= 0
    assert r["tables_over_capacity"] >= 10
    # LMDB really used (by the step, or by the lookahead thread for it)
    assert r["tiers"]["ssd"]["lookups"] + r["prefetch"]["ssd"]["lookups"] > 0 and r["tiers"]["ssd"]["rows"] > 0
    assert [c["step"] for c in r["checkpoints"]] == [6] and "checkpoints 1 (steps 6)" in out
    for key in ("train_auc", "test_auc", "train_logloss", "test_logloss"):
        assert np.isfinite(r[key])


def test_the_window_is_on_by_default_where_hbm_pins_two_batches(tmp_path):
    """Default --lookahead: 4 where a table's HBM can pin the distinct ids of two batches
    (the most of the run's first batches) within the window's budget, else 0 (a window
    that cannot pin a batch ahead only cuts the step's chunks smaller); the model is the same."""
    data = SyntheticClicks(table_rows(3000, "uniform"), 64, 1.05, 0)
    d = distinct_ids(data, 0)
    assert d == max(np.unique(data.batch(s)[1][:, f]).shape[0] for s in (0, 1) for f in range(26))
    fits = next(h for h in range(1, 1000) if 2 * d <= pin_budget(h, 0))  # (fewer ids than the batch's 64)
    assert fits < 2 * 64
    on = _train(tmp_path / "on", "--steps", "3", "--hbm-rows", str(fits))
    off = _train(tmp_path / "off", "--steps", "3", "--hbm-rows", str(fits - 1))
    given = _train(tmp_path / "given", "--steps", "3", "--hbm-rows", str(fits - 1), "--lookahead", "2")
    assert (on["lookahead"], off["lookahead"], given["lookahead"]) == (4, 0, 2)
    if sys.platform.startswith("linux"):
        assert "tiered_emb-prefetch" not in off["thread_cpu_ms_per_step"]
    assert on["test_logloss"] == off["test_logloss"] == given["test_logloss"]


def test_the_cpu_tiers_default_to_hbm_alone_and_a_gpu_to_both(tmp_path):
    """Without --hbm-rows / --ddr-rows the CPU job holds its rows in HBM alone (the memory of
    4,096 + 4,096 before), a GPU job 4,096 in each; a flag given is kept as given."""
    assert default_rows("cpu") == (8192, 0) and default_rows("cuda") == (4096, 4096)
    tables = [TableConfig(f"t{i}", 4, 100_000) for i in range(26)]
    flags = {"hbm_rows": None, "ddr_rows": None, "policy": "lru"}
    cpu = run_tiers(types.SimpleNamespace(**flags, device="cpu"), tables)
    assert (cpu.hbm_rows, cpu.ddr_rows) == (8192, 0)
    cuda = run_tiers(types.SimpleNamespace(**flags, device="cuda"), tables)
    assert (cuda.hbm_rows, cuda.ddr_rows) == (4096, 4096)
    given = run_tiers(types.SimpleNamespace(**{**flags, "ddr_rows": 512}, device="cpu"), tables)
    assert (given.hbm_rows, given.ddr_rows) == (8192, 512)
    r = _train(tmp_path / "run", "--steps", "2", "--hbm-rows", "256", "--ddr-rows", "0")
    assert r["tiers"]["ddr"]["capacity_rows"] == 0 and r["tiers"]["ddr"]["lookups"] == 0
    assert r["tiers"]["ssd"]["lookups"] + r["prefetch"]["ssd"]["lookups"] > 0  # (HBM's victims written back)


def test_resume_from_checkpoint_is_bitwise_an_uninterrupted_run(tmp_path):
    _train(tmp_path / "whole", "--steps", "6", "--checkpoint-every", "0")
    _train(tmp_path / "parts", "--steps", "3", "--checkpoint-every", "2")
    r = _train(tmp_path / "parts", "--steps", "6", "--resume")
    assert r["steps_this_run"] == 3
    rows_a, saved_a = _state(tmp_path / "whole")
    rows_b, saved_b = _state(tmp_path / "parts")
    assert saved_a["step"] == saved_b["step"] == 6
    assert rows_a == rows_b
    _assert_same_model(saved_a["model"], saved_b["model"])


def test_checkpoint_every_k_steps_is_reported_and_leaves_the_run_bitwise_equal(tmp_path):
    """--checkpoint-every 2 over 5 steps checkpoints at steps 2 and 4 (each with the step and
    the dense state, as the final one at 5), and ends bitwise where a run with only the
    final checkpoint ends: rows, MLP weights, optimizer state."""
    common = ["--steps", "5", "--step-threads", "1", "--eval-batches", "1"]
    r_end = _train(tmp_path / "end", *common, "--checkpoint-every", "0")
    r = _train(tmp_path / "every2", *common, "--checkpoint-every", "2")
    assert [c["step"] for c in r_end["checkpoints"]] == [5]
    assert [c["step"] for c in r["checkpoints"]] == [2, 4, 5]
    for c in r["checkpoints"]:
        assert sorted(c) == ["rows_written", "seconds", "step"]
        assert isinstance(c["rows_written"], int) and c["rows_written"] > 0
    assert _epoch(tmp_path / "every2") - _epoch(tmp_path / "end") == 2
    _assert_bitwise_equal(_state(tmp_path / "end"), _state(tmp_path / "every2"))
    assert r["test_logloss"] == r_end["test_logloss"] and r["test_auc"] == r_end["test_auc"]


def test_checkpoint_every_is_documented_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--checkpoint-every CHECKPOINT_EVERY steps between checkpoints" in out and "(default: 100)" in out


def test_resume_needs_a_run(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["train", "--run-dir", str(tmp_path / "none"), "--resume", *TINY])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is usable here: tests/step/device/test_gpu.py trains on it"
)
def test_device_cuda_without_a_gpu_is_a_device_error_before_the_run_dir_is_touched(tmp_path):
    from tiered_emb.errors import DeviceError

    with pytest.raises(DeviceError, match="--device cuda"):
        main(["train", "--run-dir", str(tmp_path / "run"), "--device", "cuda", *TINY])
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not CRITEO_SAMPLE.is_file(), reason=f"{CRITEO_SAMPLE} is absent")
def test_real_criteo_sample(tmp_path):
    r = _train(tmp_path / "criteo", "--steps", "4", "--data", str(CRITEO_SAMPLE))
    assert np.isfinite(r["test_logloss"]) and 0.0 <= r["test_auc"] <= 1.0


def test_metrics():
    y = np.array([0, 1, 0, 1, 1], dtype=np.float32)
    assert auc(y, np.array([0.1, 0.9, 0.2, 0.8, 0.7])) == 1.0
    assert auc(y, np.array([0.5] * 5)) == 0.5
    assert log_loss(y, np.full(5, 0.5)) == pytest.approx(np.log(2))


# --------------------------------------------------------------------------- flags and run directories
from tiered_emb.errors import ConfigError, CorruptStoreError  # noqa: E402

SMALL = [
    "--batch",
    "16",
    "--rows",
    "200",
    "--dim",
    "2",
    "--hbm-rows",
    "16",
    "--ddr-rows",
    "0",
    "--bottom",
    "4",
    "--top",
    "4",
    "--eval-batches",
    "1",
    "--quiet",
    "--step-threads",
    "1",
    "--lookahead",
    "0",
]


def _small(run_dir, *extra):
    return main(["train", "--run-dir", str(run_dir), *SMALL, *extra])


def _listing(run_dir):
    return {
        str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() and p.parent == run_dir else None
        for p in sorted(run_dir.rglob("*"))
    }


def test_bad_flags_are_refused_before_the_run_dir_is_touched(tmp_path):
    run = tmp_path / "run"
    assert _small(run, "--steps", "2") == 0
    before = _listing(run)
    bad_tsv = tmp_path / "bad.tsv"
    bad_tsv.write_text("\t".join(["x"] * 40) + "\n" + "\t".join(["1"] * 40) + "\n")
    cases = [
        (["--dim", "0"], "dim=0"),
        (["--bottom", "x"], "MLP sizes 'x'"),
        (["--top", "4,0"], "MLP sizes"),
        (["--data", str(tmp_path / "none.tsv")], "not a file"),
        (["--data", str(bad_tsv)], "bad.tsv"),
        (["--steps", "-5"], "--steps -5"),
        (["--eval-batches", "0"], "--eval-batches 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--lookahead", "-1"], "--lookahead"),
        (["--step-threads", "0"], "--step-threads"),
        (["--seed", "-1"], "--seed -1"),
        (["--alpha", "nan"], "--alpha"),
        (["--dense-lr", "-1"], "--dense-lr"),
        (["--lr", "-1"], "lr=-1"),
        (["--lr-schedule", "cosine", "--warmup-steps", "-1"], "--warmup-steps"),
        (["--weight-decay", "nan"], "--weight-decay"),
        (["--min-count", "0"], "min_count=0"),
        (["--rows", "0"], "--rows 0"),
        (["--batch", "0"], "--batch 0"),
        (["--policy", "mru"], "policy"),
        (["--hbm-rows", "0"], "hbm_rows"),
        (["--dtype", "fp8"], "--dtype"),
        (["--hbm", "10B"], "holds no row"),
        (["--ddr", "1MiB"], "--ddr-bytes is given without --hbm-bytes"),
        (["--reserve", "C1=1KiB"], "--reserve is given without --hbm-bytes"),
        (["--hbm", "1MiB", "--reserve", "C99=1KiB"], "does not hold"),
        (["--hbm", "1MiB", "--reserve", "C1=2MiB"], "more HBM bytes"),
    ]
    for flags, match in cases:
        with pytest.raises(ConfigError, match=match):
            _small(run, "--steps", "1", *flags)
        assert _listing(run) == before, flags


def test_a_run_dir_that_is_not_a_run_is_not_replaced(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        _small(f, "--steps", "1")
    assert f.read_text() == "x"
    d = tmp_path / "other"
    d.mkdir()
    (d / "keep.txt").write_text("not a run")
    with pytest.raises(ConfigError, match=r"no run that `tiered-emb train` made"):
        _small(d, "--steps", "1")
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"]
    with pytest.raises(ConfigError, match="cannot be made"):
        _small(f / "run", "--steps", "1")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _small(empty, "--steps", "1") == 0  # an empty folder, or a run, is replaced


def test_resume_refuses_flags_that_differ_from_the_run(tmp_path):
    run = tmp_path / "run"
    assert _small(run, "--steps", "1") == 0
    before = _listing(run)
    with pytest.raises(ConfigError, match=r"--dim 32 .*--optimizer 'sgd' .*--lr 0\.5 .*--seed 9") as e:
        main(
            [
                "train",
                "--run-dir",
                str(run),
                "--steps",
                "2",
                "--resume",
                "--quiet",
                "--dim",
                "32",
                "--optimizer",
                "sgd",
                "--lr",
                "0.5",
                "--seed",
                "9",
                "--top",
                "4",
            ]
        )
    assert "--top" not in str(e.value)  # given, but the run's value
    with pytest.raises(ConfigError, match="--data"):
        main(["train", "--run-dir", str(run), "--steps", "2", "--resume", "--data", str(tmp_path / "a.tsv")])
    assert _listing(run) == before
    # the run's own values, and flags that are not the run's identity, may be given
    r = main(
        [
            "train",
            "--run-dir",
            str(run),
            *SMALL,
            "--steps",
            "2",
            "--resume",
            "--hbm-rows",
            "32",
            "--lookahead",
            "2",
            "--bottom",
            "4,",
            "--checkpoint-every",
            "0",
        ]
    )
    assert r == 0 and json.loads((run / "report.json").read_text())["steps"] == 2


def test_the_step_thread_count_is_kept_with_the_run(tmp_path, monkeypatch):
    """torch sums in another order on another thread count, so the run keeps its own: a
    resume without --step-threads (on a machine whose default differs) goes on with it,
    and a different one is refused before anything is touched."""
    import tiered_emb.apps.dlrm as dlrm

    run = tmp_path / "run"
    _train(run, "--steps", "2", "--step-threads", "1")
    assert json.loads((run / "config.json").read_text())["step_threads"] == 1
    monkeypatch.setattr(dlrm.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert dlrm._step_threads(types.SimpleNamespace(step_threads=None)) == 7  # this "machine"'s default
    before = _listing(run)
    with pytest.raises(ConfigError, match=r"--step-threads 2 .*the run's: 1"):
        _train(run, "--steps", "3", "--resume", "--step-threads", "2")
    assert _listing(run) == before
    r = _train(run, "--steps", "3", "--resume")
    assert r["step_threads"] == 1 and r["steps"] == 3
    # a run kept before the thread count was: the flag, else the machine's default, as then,
    # and that count is kept from then on
    cfg = json.loads((run / "config.json").read_text())
    del cfg["step_threads"]
    (run / "config.json").write_text(json.dumps(cfg))
    assert _train(run, "--steps", "4", "--resume", "--step-threads", "2")["step_threads"] == 2
    assert json.loads((run / "config.json").read_text())["step_threads"] == 2
    assert _train(run, "--steps", "5", "--resume")["step_threads"] == 2
    # a count that is not one is a damaged config.json, refused before anything is touched
    for bad in ("2", 0, True, 1.0):
        cfg["step_threads"] = bad
        (run / "config.json").write_text(json.dumps(cfg))
        before = _listing(run)
        with pytest.raises(CorruptStoreError, match="step_threads"):
            _train(run, "--steps", "6", "--resume")
        assert _listing(run) == before


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", '{"dim": 4}', "\udcff"], ids=["json", "list", "keys", "utf8"])
def test_resume_with_a_corrupt_config_json(tmp_path, text):
    run = tmp_path / "run"
    assert _small(run, "--steps", "1") == 0
    (run / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CorruptStoreError, match=r"config\.json"):
        _small(run, "--steps", "2", "--resume")


# --------------------------------------------------------------------------- interrupted runs
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("whole") / "run"
    _train(run, "--steps", "6", "--checkpoint-every", "0", "--step-threads", "1", "--eval-batches", "1")
    return _state(run)


@pytest.mark.parametrize(
    "lookahead, exc, at_forward",
    [("0", KeyboardInterrupt, 4), ("4", RuntimeError, 4), ("4", KeyboardInterrupt, 6), ("0", RuntimeError, 2)],
)
def test_resume_after_an_interrupted_step_is_bitwise_an_uninterrupted_run(
    tmp_path, monkeypatch, uninterrupted, lookahead, exc, at_forward
):
    """A step that raises (or Ctrl-C) closes the store without a checkpoint: the rows stay
    those saved with the last step and dense weights, so --resume applies no update twice
    (was: close() checkpointed the rows as of the interruption)."""
    import tiered_emb.apps.dlrm as dlrm

    real_build = dlrm.build_model
    calls = {"n": 0}

    def build_interrupting(*a, **k):
        model = real_build(*a, **k)
        forward = model.forward

        def interrupting(dense, feats):
            calls["n"] += 1
            if calls["n"] == at_forward:  # in step at_forward - 1, after its rows were read
                forward(dense, feats)
                raise exc("interrupted")
            return forward(dense, feats)

        model.forward = interrupting
        return model

    common = ["--steps", "6", "--step-threads", "1", "--eval-batches", "1", "--lookahead", lookahead]
    monkeypatch.setattr(dlrm, "build_model", build_interrupting)
    with pytest.raises(exc):
        _train(tmp_path / "parts", *common, "--checkpoint-every", "2")
    monkeypatch.setattr(dlrm, "build_model", real_build)
    r = _train(tmp_path / "parts", *common, "--resume", "--checkpoint-every", "2")
    start = 2 * ((at_forward - 1) // 2)  # the last scheduled checkpoint before the interruption
    assert r["steps_this_run"] == 6 - start
    assert [c["step"] for c in r["checkpoints"]] == list(range(start + 2, 7, 2))  # the schedule goes on
    state = _state(tmp_path / "parts")
    assert state[1]["step"] == 6
    _assert_bitwise_equal(uninterrupted, state)


def test_a_warmup_then_decay_schedule_resumes_bitwise(tmp_path):
    """The rates are a function of the step and the run's config.json: a run cut in two with
    a cosine schedule ends bitwise where an uninterrupted one does, and apart from a constant rate."""
    sched = ["--lr-schedule", "cosine", "--warmup-steps", "2", "--decay-steps", "4", "--weight-decay", "0.01"]
    whole = _train(tmp_path / "whole", "--steps", "6", "--checkpoint-every", "0", *sched)
    _train(tmp_path / "parts", "--steps", "3", "--checkpoint-every", "2", *sched)
    r = _train(tmp_path / "parts", "--steps", "6", "--resume")  # the schedule is the run's
    assert r["steps_this_run"] == 3 and whole["lr_schedule"] == "cosine"
    assert whole["lr_final"] == r["lr_final"] == pytest.approx(0.05 * 0.5 * (1 + math.cos(math.pi * 4 / 4)))
    rows_a, saved_a = _state(tmp_path / "whole")
    rows_b, saved_b = _state(tmp_path / "parts")
    assert rows_a == rows_b
    _assert_same_model(saved_a["model"], saved_b["model"])
    constant = _train(tmp_path / "constant", "--steps", "6", "--checkpoint-every", "0")
    assert constant["lr_final"] == 0.05
    assert _state(tmp_path / "constant")[0] != rows_a


def test_lr_factor_warms_up_then_decays():
    from tiered_emb.apps.dlrm_config import lr_factor

    cfg = {"warmup_steps": 4, "decay_steps": 10}
    cosine = [lr_factor(dict(cfg, lr_schedule="cosine"), s) for s in range(16)]
    poly = [lr_factor(dict(cfg, lr_schedule="poly"), s) for s in range(16)]
    assert cosine[:4] == poly[:4] == [0.25, 0.5, 0.75, 1.0]
    assert cosine[4] == poly[4] == 1.0
    assert cosine[9] == pytest.approx(0.5) and poly[9] == pytest.approx(0.25)
    assert cosine[14:] == poly[14:] == [0.0, 0.0]
    assert sorted(cosine[4:], reverse=True) == cosine[4:]
    assert lr_factor(dict(cfg, lr_schedule="constant"), 100) == 1.0


def test_a_run_kept_before_schedules_resumes_with_a_constant_rate(tmp_path):
    _train(tmp_path / "old", "--steps", "2")
    path = tmp_path / "old" / "config.json"
    cfg = json.loads(path.read_text())
    for k in ("lr_schedule", "warmup_steps", "decay_steps", "weight_decay", "min_count"):
        del cfg[k]
    path.write_text(json.dumps(cfg))
    r = _train(tmp_path / "old", "--steps", "3", "--resume")
    assert r["steps_this_run"] == 1 and r["lr_final"] == 0.05


def test_narrow_rows_sized_in_bytes_train_and_resume_keeps_the_dtype(tmp_path):
    """--dtype bf16 with --hbm / --ddr in bytes (replacing the rows flags): one HBM and one
    DDR tier shared by the 26 tables, each row a slot of bfloat16's record (dim 4 + row-wise
    Adagrad's word: 3 words, 12 bytes); a resume goes on in the run's dtype and refuses another."""
    run = tmp_path / "r"
    report = _train(run, "--steps", "2", "--dtype", "bf16", "--hbm", "312KiB", "--ddr", "156KiB")
    assert report["capacity_rows"] == 312 * 1024 // 12 + 156 * 1024 // 12
    with TieredStore.open(run / "store") as store:
        assert {store.engine.table_config(n).dtype for n in store.tables} == {"bfloat16"}
        assert (store.engine.tiers.hbm_bytes, store.engine.tiers.ddr_bytes) == (312 * 1024, 156 * 1024)
        for name in store.tables:
            store.lookup(name, np.arange(2000))
        held = store.stats()
        assert sum(held[n]["hbm"]["rows"] for n in held) == 312 * 1024 // 12
        assert sum(held[n]["hbm"]["bytes"] for n in held) == 312 * 1024
    assert main(["train", "--run-dir", str(run), *TINY, "--steps", "3", "--resume", "--dtype", "bfloat16"]) == 0
    with pytest.raises(ConfigError, match="--dtype"):
        main(["train", "--run-dir", str(run), *TINY, "--steps", "4", "--resume", "--dtype", "float32"])


def test_a_table_given_bytes_of_its_own_holds_them_and_no_more(tmp_path):
    """--reserve C1=12KiB:6KiB: table C1 in tiers of its own (bfloat16 rows of 12 bytes),
    the other 25 tables sharing what is left of --hbm / --ddr."""
    run = tmp_path / "r"
    flags = ["--steps", "2", "--dtype", "bf16", "--hbm", "312KiB", "--ddr", "156KiB", "--reserve", "C1=12KiB:6KiB"]
    report = _train(run, *flags)
    assert report["capacity_rows"] == (312 + 156) * 1024 // 12
    with TieredStore.open(run / "store") as store:
        assert store.engine.tiers.reserved == (("C1", 12 * 1024, 6 * 1024),)
        for name in store.tables:
            store.lookup(name, np.arange(2000))
        held = store.stats()
    assert (held["C1"]["hbm"]["rows"], held["C1"]["ddr"]["rows"]) == (1024, 512)
    assert sum(held[n]["hbm"]["rows"] for n in held if n != "C1") == 300 * 1024 // 12


@pytest.mark.parametrize("bad", ["C1", "C1=", "=1MiB", "C1=1MiB:lots"])
def test_a_reservation_flag_that_does_not_parse_names_its_form(tmp_path, capsys, bad):
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", str(tmp_path / "r"), *TINY, "--hbm", "1MiB", "--reserve", bad])
    assert "--reserve" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_criteo_cardinalities_give_each_table_its_size_and_the_shared_tiers_follow(tmp_path):
    """--cardinalities criteo: the 26 tables take Criteo's Kaggle sizes at most --rows (C9:
    3 ids, C3: 3000), the data's ids stay in them, and shared tiers hold a small table's
    few rows where rows per table would give it a tier of 128; a resume keeps the sizes."""
    run = tmp_path / "r"
    _train(run, "--steps", "3", "--cardinalities", "criteo", "--hbm", "64KiB", "--ddr", "32KiB")
    with TieredStore.open(run / "store") as store:
        sizes = {n: store.engine.table_config(n).num_rows for n in store.tables}
        for name in sorted(store.tables):  # every row of every table, once
            store.lookup(name, np.arange(sizes[name]))
        held = store.stats()
    assert sizes == {f"C{i + 1}": min(3000, n) for i, n in enumerate(CRITEO_KAGGLE_ROWS)}
    assert held["C9"]["hbm"]["rows"] + held["C9"]["ddr"]["rows"] <= 3
    # the shared tiers are full: the large tables take what the small ones leave
    assert sum(held[n][t]["rows"] for n in held for t in ("hbm", "ddr")) == sum(
        held["C1"][t]["capacity_rows"] for t in ("hbm", "ddr")
    )
    cats = SyntheticClicks(table_rows(3000, "criteo"), 64).batch(0)[1]
    assert (cats < np.array([min(3000, n) for n in CRITEO_KAGGLE_ROWS])).all()
    with pytest.raises(ConfigError, match="--cardinalities"):
        main(["train", "--run-dir", str(run), *TINY, "--steps", "4", "--resume", "--cardinalities", "uniform"])
    assert main(["train", "--run-dir", str(run), *TINY, "--steps", "4", "--resume"]) == 0
