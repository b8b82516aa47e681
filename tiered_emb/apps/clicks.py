"""Click data shaped like Criteo's: 13 dense and 26 categorical features, a 0/1 label.

Two sources with one interface, ``batch(step, split) -> (dense, cats, labels)``, where a
batch is a pure function of (seed, split, step): a run resumed at step s sees exactly
the batches an uninterrupted run would.

- :class:`SyntheticClicks`: Zipf-skewed ids per feature and a *planted* signal: every
  (feature, id) of the informative features carries a fixed effect on the click logit
  (a hash of seed, feature, id), and the dense features a fixed linear one.  A model
  that learns the hot ids' effects reaches an AUC well above 0.5.
- :class:`CriteoTSV`: a real Criteo-format file (label, 13 integer, 26 hex categorical
  columns, tab separated, empty = missing); hex values hashed into ``num_rows`` buckets;
  the last ``test_fraction`` of the lines held out.

Dense features are returned as ``log1p(max(x, 0))``, as DLRM's reference code does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiered_emb._args import finite_arg, int_arg
from tiered_emb.errors import ConfigError
from tiered_emb.sim.traces import zipf_ids

NUM_DENSE = 13
NUM_CATS = 26
_SPLITS = {"train": 0, "test": 1}
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_CRITEO_HINT = "give a Criteo-format TSV: a label, 13 numbers, 26 hex hashes, tab separated"
#: Distinct values of each categorical feature of Criteo's Kaggle set (the table sizes of
#: DLRM's reference runs on it): from 3 to 10,131,227.
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
#: ``--cardinalities``: every table ``--rows`` ids, or Criteo's sizes at most ``--rows``.
CARDINALITIES = ("uniform", "criteo")


def table_rows(rows: int, cardinalities: str = "uniform") -> list[int]:
    """Rows of each of the 26 tables: ``rows`` each (``"uniform"``), or Criteo's Kaggle
    sizes capped at ``rows`` (``"criteo"``: from 3 ids up, the largest tables ``rows``)."""
    if cardinalities not in CARDINALITIES:
        raise ConfigError(f"--cardinalities {cardinalities!r} is unknown", f"use one of {list(CARDINALITIES)}")
    if cardinalities == "criteo":
        return [min(rows, n) for n in CRITEO_KAGGLE_ROWS]
    return [rows] * NUM_CATS


def _rows_of(num_rows) -> list[int]:
    """Rows of each table from an int (every table) or 26 ints; ConfigError otherwise."""
    each = [num_rows] * NUM_CATS if not isinstance(num_rows, (list, tuple)) else list(num_rows)
    if len(each) != NUM_CATS:
        raise ConfigError(f"num_rows has {len(each)} entries", f"give one int, or {NUM_CATS} (one a table)")
    return [int_arg("num_rows", n, 1, hint="use ints >= 1") for n in each]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _check_split(split: str) -> int:
    if split not in _SPLITS:
        raise ConfigError(f"split={split!r} is invalid", "use 'train' or 'test'")
    return _SPLITS[split]


class SyntheticClicks:
    """Seeded synthetic Criteo-like batches with a learnable planted signal.

    Parameters
    ----------
    num_rows : int or list of 26 ints, distinct ids per categorical feature
    batch_size : int
    alpha : float, Zipf skew of the ids
    seed : int
    informative : int, how many categorical features carry an effect (the first ones)
    effect : float, the largest effect of one id on the logit

    Examples
    --------
    >>> d, c, y = SyntheticClicks(1000, 4).batch(0, "train")
    >>> d.shape, c.shape, y.shape, d.dtype, c.dtype
    ((4, 13), (4, 26), (4,), dtype('float32'), dtype('int64'))
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        alpha: float = 1.05,
        seed: int = 0,
        informative: int = 8,
        effect: float = 1.2,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} is invalid", "use an int >= 1")
        self.num_rows = _rows_of(num_rows)
        self.batch_size = batch_size
        self.alpha = float(alpha)
        self.seed = int(seed)
        self.informative = int(informative)
        self.effect = float(effect)
        rng = np.random.default_rng([self.seed, 7])
        self._dense_w = rng.normal(0.0, 0.35, NUM_DENSE).astype(np.float64)
        self._dense_mu = rng.uniform(0.5, 2.5, NUM_DENSE)

    def _effects(self, f: int, ids: np.ndarray) -> np.ndarray:
        """Fixed effect in [-effect, effect] of each id of feature ``f``."""
        key = _splitmix64(np.uint64(self.seed) * np.uint64(1_000_003) + np.uint64(f))
        h = _splitmix64(ids.astype(np.uint64) ^ key)
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return self.effect * (2.0 * u - 1.0)

    def batch(self, step: int, split: str = "train"):
        """``(dense float32 (B, 13), cats int64 (B, 26), labels float32 (B,))`` of batch ``step``."""
        code = _check_split(split)
        b = self.batch_size
        rng = np.random.default_rng([self.seed, code, int(step)])
        counts = np.floor(np.exp(rng.normal(self._dense_mu, 1.0, (b, NUM_DENSE))))
        dense = np.log1p(counts)
        cats = np.empty((b, NUM_CATS), dtype=np.int64)
        logit = -1.1 + (dense - self._dense_mu) @ self._dense_w
        for f in range(NUM_CATS):
            sub = int(rng.integers(0, 2**62))
            cats[:, f] = zipf_ids(self.num_rows[f], self.alpha, b, seed=sub)
            if f < self.informative:
                logit += self._effects(f, cats[:, f])
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return dense.astype(np.float32), cats, labels


class CriteoTSV:
    """Batches from a Criteo-format TSV file held in memory.

    Parameters
    ----------
    path : str or Path
    num_rows : int or list of 26 ints, hash buckets per categorical feature (``int(hex, 16) % num_rows``)
    batch_size : int
    test_fraction : float, the last lines held out

    Train batches cycle over the train lines in file order; test batches likewise.
    """

    def __init__(self, path, num_rows: int, batch_size: int, test_fraction: float = 0.1):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"data path {str(path)!r} is not a file", "give a Criteo-format TSV (label, 13 ints, 26 hex)"
            )
        rows = _rows_of(num_rows)
        batch_size = int_arg("batch_size", batch_size, 1, hint="use an int >= 1")
        test_fraction = finite_arg("test_fraction", test_fraction, 0.0, hint="use a fraction in [0, 1)")
        if test_fraction >= 1:
            raise ConfigError(f"test_fraction={test_fraction} is invalid", "use a fraction in [0, 1)")
        labels, dense, cats = [], [], []
        with open(path, encoding="utf-8") as f:
            lineno = 0
            try:
                for lineno, line in enumerate(f, 1):
                    cols = line.rstrip("\n").split("\t")
                    if len(cols) != 1 + NUM_DENSE + NUM_CATS:
                        raise ConfigError(
                            f"{str(path)!r} line {lineno} has {len(cols)} columns",
                            f"give {1 + NUM_DENSE + NUM_CATS} tab-separated columns",
                        )
                    labels.append(float(cols[0]))
                    dense.append([float(x) if x else 0.0 for x in cols[1 : 1 + NUM_DENSE]])
                    cats.append([int(x, 16) % n if x else 0 for x, n in zip(cols[1 + NUM_DENSE :], rows, strict=True)])
            except ConfigError:
                raise
            except UnicodeDecodeError:
                raise ConfigError(f"{str(path)!r} is not UTF-8 text after line {lineno}", _CRITEO_HINT) from None
            except ValueError as err:  # a label or count that is no number, a hash that is not hex
                raise ConfigError(f"{str(path)!r} line {lineno}: {err}", _CRITEO_HINT) from None
        n = len(labels)
        n_test = max(1, round(n * test_fraction)) if n > 1 else 0
        if n - n_test < 1:
            raise ConfigError(f"{str(path)!r} has {n} lines", "give at least 2 lines")
        d = np.log1p(np.maximum(np.asarray(dense, dtype=np.float64), 0.0)).astype(np.float32)
        c = np.asarray(cats, dtype=np.int64)
        y = np.asarray(labels, dtype=np.float32)
        cut = n - n_test
        self._parts = {"train": (d[:cut], c[:cut], y[:cut]), "test": (d[cut:], c[cut:], y[cut:])}
        self.num_rows = rows
        self.batch_size = batch_size

    def __len__(self) -> int:
        return sum(p[2].shape[0] for p in self._parts.values())

    def batch(self, step: int, split: str = "train"):
        """Batch ``step`` of ``split``, wrapping around the lines."""
        _check_split(split)
        d, c, y = self._parts[split]
        n = y.shape[0]
        if n == 0:
            raise ConfigError(f"split {split!r} is empty", "give a larger file")
        idx = (int(step) * self.batch_size + np.arange(self.batch_size)) % n
        return d[idx], c[idx], y[idx]


__all__ = ["CARDINALITIES", "CRITEO_KAGGLE_ROWS", "NUM_CATS", "NUM_DENSE", "CriteoTSV", "SyntheticClicks", "table_rows"]
