"""Configuration: frozen dataclasses validated when built.

Every invalid field raises :class:`~tiered_emb.errors.ConfigError` naming the field and
the value given, with a hint.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from tiered_emb.errors import ConfigError
from tiered_emb.optimizers import (
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    RowWiseAdagrad,
    optimizer_from_dict,
    optimizer_to_dict,
    with_learning_rate,
)

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")  # used with fullmatch: '$' would let "a\n" pass
MAX_ID = 2**63 - 1
MAX_DIM = 65536
# Rows are float32: every number that ends up in a row (an initial value, an optimizer's
# hyperparameter) must be finite as float32, i.e. at most this in magnitude.
FLOAT32_MAX = 3.4028234663852886e38
# The largest |z| the Normal initialiser can draw (Box-Muller with u1 >= 2**-53).
_NORMAL_Z_MAX = math.sqrt(-2.0 * math.log(2.0**-53))
# LMDB maps its whole file into the address space: 2**48 bytes (256 TiB) is the virtual
# address space of a 64-bit CPU with 48-bit addresses (x86-64, arm64); a larger map can
# never be mapped there (and beyond 2**64 py-lmdb raises OverflowError).
MAX_MAP_SIZE_BYTES = 1 << 48


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float (numpy scalars included), not a bool, a complex or a string."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _plain_number(obj: object, field_name: str) -> None:
    """Store a numpy scalar (or other Real) field of a frozen config as a Python float, so it
    serialises to JSON; ints and floats are kept as given."""
    v = getattr(obj, field_name)
    if not isinstance(v, (int, float)):
        object.__setattr__(obj, field_name, float(v))


def _fits_float32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


@dataclass(frozen=True)
class Uniform:
    """Initial weights drawn from ``Uniform(low, high)``."""

    low: float = -0.05
    high: float = 0.05
    name = "uniform"

    def __post_init__(self) -> None:
        if not (_is_real(self.low) and _is_real(self.high)):
            raise ConfigError(f"Uniform(low={self.low!r}, high={self.high!r}) is invalid", "use numbers low < high")
        _plain_number(self, "low")
        _plain_number(self, "high")
        if not (_fits_float32(self.low) and _fits_float32(self.high) and self.low < self.high):
            raise ConfigError(
                f"Uniform(low={self.low!r}, high={self.high!r}) is invalid",
                f"use finite low < high, each at most {FLOAT32_MAX:.7g} in magnitude (rows are float32)",
            )


@dataclass(frozen=True)
class Normal:
    """Initial weights drawn from ``Normal(mean, std)``."""

    std: float = 0.01
    mean: float = 0.0
    name = "normal"

    def __post_init__(self) -> None:
        if not (_is_real(self.std) and _is_real(self.mean)):
            raise ConfigError(
                f"Normal(std={self.std!r}, mean={self.mean!r}) is invalid", "use numbers: a std > 0, a mean"
            )
        _plain_number(self, "std")
        _plain_number(self, "mean")
        if not (math.isfinite(self.std) and self.std > 0 and math.isfinite(self.mean)):
            raise ConfigError(f"Normal(std={self.std!r}, mean={self.mean!r}) is invalid", "use a finite std > 0")
        if abs(self.mean) + _NORMAL_Z_MAX * self.std > FLOAT32_MAX:
            raise ConfigError(
                f"Normal(std={self.std!r}, mean={self.mean!r}) is invalid",
                f"|mean| + {_NORMAL_Z_MAX:.3f} * std (the largest draw) must be at most "
                f"{FLOAT32_MAX:.7g}: rows are float32",
            )


INITS: dict[str, type[Uniform] | type[Normal]] = {"uniform": Uniform, "normal": Normal}


#: the row precisions a table takes (:mod:`tiered_emb.precision`)
DTYPES = ("float32", "float16", "bfloat16", "int8")


def weight_words(dtype: str, dim: int) -> int:
    """The 32-bit words of ``dim`` weights in ``dtype``: float32 one a weight, 16-bit floats
    two a word, int8 four a word after a float32 scale and bias."""
    if dtype == "float32":
        return dim
    if dtype == "int8":
        return 2 + (dim + 3) // 4
    return (dim + 1) // 2


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Parameters
    ----------
    name : str
        Letters, digits, ``_ . -``; unique within a store.
    dim : int
        Row width (1..65536).
    num_rows : int or None
        ``None``: ids are any int64 >= 0 (unbounded, rows exist once touched);
        an int bounds ids to ``[0, num_rows)``.
    dtype : str
        The weights' precision in every tier, on disk and in exports: ``"float32"``,
        ``"float16"``, ``"bfloat16"`` or ``"int8"`` (row-wise, a float32 scale and bias a
        row).  Rows are gathered and pooled in float32, the optimizer state stays float32,
        and updates round stochastically (:mod:`tiered_emb.precision`).
    init : Uniform | Normal
        Initialiser of rows never written; a pure function of (seed, table, id).
    optimizer : SGD | Adagrad | RowWiseAdagrad | Adam
        Applied by :meth:`TieredStore.apply_gradients`; its state lives in the row.
    min_count : int
        Admission: an id's gradients update its row from the update that sees it for the
        ``min_count``-th time on (1..255; 1: every id at once).  Before, its gradients are
        dropped and it reads as its initial value; nothing of it reaches LMDB
        (:mod:`tiered_emb.admission`).
    admission_bytes : int
        Memory of the admission counts (>= 4096): one byte per id of a bounded table that
        fits, else a count-min sketch of this many bytes (docs/tuning.md: its error).
    ttl_steps : int or None
        Expiry: a row no update touched for more than this many steps (the store's step
        counter, :meth:`TieredStore.advance_step`) is deleted; None: rows never expire.
        Its record holds one more word, the step of its last update (:mod:`tiered_emb.expiry`).
    init_table : str or None
        The table name that keys the initial rows (None: this table's own).  With
        ``init_column``, a table holding columns ``c..c+dim`` of another starts with exactly
        those columns of its rows: a column-wise shard (:mod:`tiered_emb.distributed`).
    init_column : int
        The column of ``init_table``'s rows that this table's first column is (>= 0).
    state_dtype : str
        The precision of the optimizer's state arrays (Adagrad's sums of squares, Adam's m
        and v): ``"float32"`` (the default) or ``"bfloat16"`` (half their bytes, rounded as
        the weights are); a row's single words (row-wise Adagrad's, Adam's step) stay float32.
    rounding : str
        How an update writes a narrow ``dtype`` or ``state_dtype``: ``"stochastic"`` (the default: unbiased,
        from bits that are a pure function of seed, table, id, column and step) or
        ``"nearest"`` (ties to even; an update smaller than half a step of the dtype is lost).

    Examples
    --------
    >>> from tiered_emb import RowWiseAdagrad
    >>> TableConfig("user", dim=64, optimizer=RowWiseAdagrad(lr=0.05)).record_width
    65
    """

    name: str
    dim: int
    num_rows: int | None = None
    dtype: str = "float32"
    init: Uniform | Normal = field(default_factory=Uniform)
    optimizer: SGD | Adagrad | RowWiseAdagrad | Adam = field(default_factory=SGD)
    min_count: int = 1
    admission_bytes: int = 1 << 22
    ttl_steps: int | None = None
    init_table: str | None = None
    init_column: int = 0
    rounding: str = "stochastic"
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"TableConfig.name={self.name!r} is invalid", "use 1-200 letters, digits, '_', '.' or '-'"
            )
        if not _is_int(self.dim) or not 1 <= self.dim <= MAX_DIM:
            raise ConfigError(f"TableConfig.dim={self.dim!r} is invalid", "use an int in 1..65536")
        if self.num_rows is not None and (not _is_int(self.num_rows) or not 1 <= self.num_rows <= MAX_ID):
            raise ConfigError(
                f"TableConfig.num_rows={self.num_rows!r} is invalid", "use None (unbounded ids) or an int >= 1"
            )
        if not _is_int(self.min_count) or not 1 <= self.min_count <= 255:
            raise ConfigError(
                f"TableConfig.min_count={self.min_count!r} is invalid",
                "use an int in 1..255 (1: every id admitted at once)",
            )
        if not _is_int(self.admission_bytes) or not 4096 <= self.admission_bytes <= 1 << 40:
            raise ConfigError(
                f"TableConfig.admission_bytes={self.admission_bytes!r} is invalid",
                "use an int from 4096 to 2**40 (bytes of the admission counts)",
            )
        if self.ttl_steps is not None and (not _is_int(self.ttl_steps) or not 1 <= self.ttl_steps < 2**31):
            raise ConfigError(
                f"TableConfig.ttl_steps={self.ttl_steps!r} is invalid",
                "use None (rows never expire) or an int >= 1: the steps a row may go without an update",
            )
        named = isinstance(self.init_table, str) and _NAME_RE.fullmatch(self.init_table)
        if self.init_table is not None and not named:
            raise ConfigError(
                f"TableConfig.init_table={self.init_table!r} is invalid",
                "use None (this table's name) or a table name: 1-200 letters, digits, '_', '.' or '-'",
            )
        if not _is_int(self.init_column) or not 0 <= self.init_column <= MAX_DIM:
            raise ConfigError(
                f"TableConfig.init_column={self.init_column!r} is invalid",
                f"use an int from 0 to {MAX_DIM}: the column of init_table's rows this table starts at",
            )
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"TableConfig.dtype={self.dtype!r} is not a row precision",
                f"use one of {', '.join(DTYPES)} (docs/tuning.md, 'Row precision')",
            )
        self._check_state_dtype()
        if self.rounding not in ("stochastic", "nearest"):
            raise ConfigError(
                f"TableConfig.rounding={self.rounding!r} is invalid",
                "use 'stochastic' (unbiased: the default) or 'nearest' (ties to even)",
            )
        if not isinstance(self.init, (Uniform, Normal)):
            raise ConfigError(
                f"TableConfig.init={self.init!r} is invalid", "use tiered_emb.Uniform(...) or tiered_emb.Normal(...)"
            )
        if type(self.optimizer) not in OPTIMIZERS.values():
            raise ConfigError(
                f"TableConfig.optimizer={self.optimizer!r} is invalid",
                "use SGD, Adagrad, RowWiseAdagrad or Adam from tiered_emb",
            )
        # The optimizer's kernels take its hyperparameters as float32: 1e39 would be inf there.
        for f in fields(self.optimizer):
            k = f.name
            v = getattr(self.optimizer, k)
            for x in v if isinstance(v, tuple) else (v,):
                if _is_real(x) and not _fits_float32(x):
                    raise ConfigError(
                        f"TableConfig.optimizer={self.optimizer!r} is invalid: {k}={v!r} overflows float32",
                        f"use a {k} of at most {FLOAT32_MAX:.7g} in magnitude",
                    )

    def _check_state_dtype(self) -> None:
        """``state_dtype`` is a precision the optimizer's state can be held in: bfloat16 for the
        arrays of Adagrad and Adam (one value a column), float32 for any."""
        if self.state_dtype not in DTYPES:
            raise ConfigError(
                f"TableConfig.state_dtype={self.state_dtype!r} is not a precision", "use 'float32' or 'bfloat16'"
            )
        if self.state_dtype == "float32" or type(self.optimizer) not in OPTIMIZERS.values():
            return
        name = type(self.optimizer).__name__
        if not self.state_arrays:
            raise ConfigError(
                f"TableConfig.state_dtype={self.state_dtype!r}: {name} keeps no state a column (at most one "
                "float a row), nothing to narrow",
                "leave state_dtype='float32'",
            )
        if self.state_dtype != "bfloat16":
            raise ConfigError(
                f"{name} cannot hold its state in {self.state_dtype}: its sums of squared gradients "
                "fall below float16's smallest value (6e-8) and become 0"
                + (" (int8 cannot follow them at all)" if self.state_dtype == "int8" else ""),
                "use state_dtype='bfloat16' (float32's range in half the bytes) or 'float32'",
            )

    def with_learning_rate(self, lr: float) -> TableConfig:
        """This config with its optimizer's learning rate ``lr``; ConfigError for one that is
        not a finite number >= 0."""
        return dataclasses.replace(self, optimizer=with_learning_rate(self.optimizer, lr))

    @property
    def state_width(self) -> int:
        """Words of state per record, after the ``dim`` weights: the optimizer's, then with
        ``ttl_steps`` the step of the row's last update (a uint32 in the last word)."""
        return self.optimizer.state_width(self.dim) + (1 if self.ttl_steps is not None else 0)

    @property
    def weight_words(self) -> int:
        """32-bit words of a record's weights: ``dim`` in float32, fewer in a narrower ``dtype``
        (:mod:`tiered_emb.precision`)."""
        return weight_words(self.dtype, self.dim)

    @property
    def state_arrays(self) -> int:
        """How many of the optimizer's state arrays hold one value a column (Adagrad 1, Adam 2);
        the rest of its state (and the expiry word) is a few words a row."""
        return self.optimizer.state_width(2) - self.optimizer.state_width(1)

    @property
    def state_words(self) -> int:
        """32-bit words of a record's state: its arrays in ``state_dtype``, then the words a row."""
        arrays, dim = self.state_arrays, self.dim
        return arrays * weight_words(self.state_dtype, dim) + self.state_width - arrays * dim

    @property
    def packed(self) -> bool:
        """Whether a record's words differ from its float32 values (a narrow dtype or state)."""
        return self.dtype != "float32" or self.state_dtype != "float32"

    @functools.cached_property
    def record_width(self) -> int:
        """32-bit words per record as the tiers hold it: the weights in ``dtype``, then the
        optimizer state (its arrays in ``state_dtype``).  Kept once asked (the fields it
        follows are frozen): the tier path asks for it several times a table a step."""
        return self.weight_words + self.state_words

    @property
    def value_width(self) -> int:
        """Floats of a record read back as float32 (``peek(..., with_state=True)``): ``dim``
        weights then the state."""
        return self.dim + self.state_width

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON values (the store's manifest keeps it so); :meth:`from_dict` reads it."""
        init = {"name": self.init.name, **{k: getattr(self.init, k) for k in self.init.__dataclass_fields__}}
        return {
            "name": self.name,
            "dim": self.dim,
            "num_rows": self.num_rows,
            "dtype": self.dtype,
            "init": init,
            "optimizer": optimizer_to_dict(self.optimizer),
            "min_count": self.min_count,
            "admission_bytes": self.admission_bytes,
            "ttl_steps": self.ttl_steps,
            "init_table": self.init_table,
            "init_column": self.init_column,
            "rounding": self.rounding,
            "state_dtype": self.state_dtype,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConfig:
        """The config :meth:`to_dict` wrote, validated again."""
        init = dict(d["init"])
        init_cls = INITS[init.pop("name")]
        return cls(
            name=d["name"],
            dim=d["dim"],
            num_rows=d["num_rows"],
            dtype=d["dtype"],
            init=init_cls(**init),
            optimizer=optimizer_from_dict(d["optimizer"]),
            min_count=d.get("min_count", 1),  # (a manifest written before admission: none)
            admission_bytes=d.get("admission_bytes", 1 << 22),
            ttl_steps=d.get("ttl_steps"),
            init_table=d.get("init_table"),  # (a manifest written before column-wise shards: none)
            init_column=d.get("init_column", 0),
            rounding=d.get("rounding", "stochastic"),  # (a manifest written before narrow rows: none)
            state_dtype=d.get("state_dtype", "float32"),
        )


@dataclass(frozen=True)
class TierConfig:
    """Capacities and policy of the cache tiers.

    Parameters
    ----------
    hbm_rows : int
        Rows *per table* held in the HBM tier (CuPy on a GPU, NumPy otherwise); >= 1,
        unless ``hbm_bytes`` sizes the tiers instead (then 0, the default).
    ddr_rows : int
        Rows per table held in host DDR below HBM; >= 0 (0: HBM misses go to LMDB).
    hbm_bytes : int or None
        Bytes of records in *one* HBM tier shared by all the store's tables, instead of
        ``hbm_rows`` per table (:mod:`tiered_emb.tiers.pool`): rows of every table compete
        for its slots under ``policy``, each slot as wide as the widest record.  With it,
        ``ddr_bytes`` sizes the DDR tier below (``ddr_rows`` stays 0).  Bookkeeping (index,
        policy, flags: 65-105 bytes a slot) comes on top; docs/tuning.md.
    ddr_bytes : int or None
        Bytes of records in one DDR tier shared by all tables, with ``hbm_bytes`` (None: 0).
    reserved : dict or tuple
        With ``hbm_bytes``: bytes of the two budgets set apart for some tables, as
        ``{name: (hbm_bytes, ddr_bytes)}``.  Such a table gets HBM and DDR tiers of its own
        of those bytes (rows of its record width), which no other table's rows enter and
        which it does not outgrow: its floor and its cap at once.  The other tables share
        what is left of ``hbm_bytes`` and ``ddr_bytes``.  Kept as a tuple of
        ``(name, hbm_bytes, ddr_bytes)`` in name order.
    policy : str
        Eviction policy name from :data:`tiered_emb.cache.policies.POLICIES`: ``"lru"``, ``"lfu"``,
        ``"fifo"``, ``"clock"``, ``"sieve"``, ``"s3fifo"``, ``"arc"``, or one of them after ``"lookahead+"``.
    device : str
        ``"auto"`` (CuPy when a GPU is usable, else NumPy with one warning), ``"cpu"`` or ``"cuda"``
        (a GPU: the ``gpu-cuda12`` / ``gpu-cuda13`` extra, docs/gpu.md).
    ssd_compression : int or None
        zstd level (1..22) for LMDB records, or None for raw float32 bytes.
    map_size_bytes : int
        Initial LMDB map size, 2**20 (1 MiB) to 2**48 (256 TiB: LMDB maps the file into
        the address space, 48 bits on x86-64 and arm64); the map doubles by itself when full.
    background_writes : bool
        Write evicted rows to LMDB on a writer thread (default) instead of the step's; the
        rows stay readable from memory until their transaction commits.
    budget_bytes : int
        The working memory of the SSD tier, >= 1 MiB (default 256 MiB): the most bytes of
        rows one of its operations (a checkpoint's transaction, a compaction, an export's
        chunk) holds at once, beyond the tiers, the SSD index and the write-backs waiting
        in memory.  A batch's distinct rows must fit in it (docs/tuning.md).
    keep_checkpoints : int or None
        How many of the last checkpoints the store keeps, 1..1000: each one opens bitwise
        with ``TieredStore.open(path, snapshot=epoch)`` (docs/durability.md).  The rows a
        kept checkpoint reads stay on disk until it is dropped.  None (default): the
        store's own setting (1 for a new store), so a ``TierConfig`` passed to ``open`` to
        change the tiers keeps it.
    tune_malloc : bool
        Keep the memory of the SSD tier's large writes for the next one (default True):
        glibc's ``mallopt`` thresholds, set for the whole process at a store's first write
        (and in its writer process), so that buffers up to 32 MiB come from the heap and
        free memory up to a quarter of ``budget_bytes`` (32 MiB to 1 GiB) is not given back.
        False leaves the process's allocator as it is (what it is worth: docs/tuning.md).
        No effect off glibc.
    """

    hbm_rows: int = 0
    ddr_rows: int = 0
    policy: str = "lru"
    device: str = "auto"
    ssd_compression: int | None = None
    map_size_bytes: int = 1 << 28
    background_writes: bool = True
    budget_bytes: int = 256 << 20
    keep_checkpoints: int | None = None
    tune_malloc: bool = True
    hbm_bytes: int | None = None
    ddr_bytes: int | None = None
    reserved: Any = ()

    def __post_init__(self) -> None:
        from tiered_emb.cache.policies import POLICIES

        self._check_sizes()
        self._check_reserved()
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"TierConfig.policy={self.policy!r} is unknown", f"use one of {sorted(POLICIES)}")
        if not isinstance(self.device, str) or self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"TierConfig.device={self.device!r} is invalid", "use 'auto', 'cpu' or 'cuda'")
        level = self.ssd_compression
        if level is not None and (not _is_int(level) or not 1 <= level <= 22):
            raise ConfigError(
                f"TierConfig.ssd_compression={self.ssd_compression!r} is invalid",
                "use None (no compression) or a zstd level in 1..22",
            )
        if not _is_int(self.map_size_bytes) or not (1 << 20) <= self.map_size_bytes <= MAX_MAP_SIZE_BYTES:
            raise ConfigError(
                f"TierConfig.map_size_bytes={self.map_size_bytes!r} is invalid",
                "use an int from 1 MiB (2**20) to 256 TiB (2**48, what a 64-bit address space "
                "can map); the map grows by itself when full",
            )
        if not isinstance(self.background_writes, bool):
            raise ConfigError(
                f"TierConfig.background_writes={self.background_writes!r} is invalid", "use True or False"
            )

        if not _is_int(self.budget_bytes) or not (1 << 20) <= self.budget_bytes <= 2**48:
            raise ConfigError(
                f"TierConfig.budget_bytes={self.budget_bytes!r} is invalid",
                "use an int from 1 MiB (2**20) up, sized to the memory the SSD tier may use at once",
            )
        if not isinstance(self.tune_malloc, bool):
            raise ConfigError(f"TierConfig.tune_malloc={self.tune_malloc!r} is invalid", "use True or False")
        keep = self.keep_checkpoints
        if keep is not None and (not _is_int(keep) or not 1 <= keep <= 1000):
            raise ConfigError(
                f"TierConfig.keep_checkpoints={keep!r} is invalid",
                "use an int in 1..1000 (how many of the last checkpoints the store keeps), or None",
            )

    def _check_sizes(self) -> None:
        """The tiers' sizes: rows per table, or bytes for tiers shared by the tables."""
        if not _is_int(self.ddr_rows) or self.ddr_rows < 0 or self.ddr_rows > 2**31 - 1:
            raise ConfigError(f"TierConfig.ddr_rows={self.ddr_rows!r} is invalid", "use an int in 0..2**31-1")
        if self.hbm_bytes is None:
            if self.ddr_bytes is not None:
                raise ConfigError(
                    f"TierConfig.ddr_bytes={self.ddr_bytes!r} is given without hbm_bytes",
                    "size both shared tiers in bytes (hbm_bytes and ddr_bytes), or both per table in rows",
                )
            if not _is_int(self.hbm_rows) or self.hbm_rows < 1 or self.hbm_rows > 2**31 - 1:
                raise ConfigError(
                    f"TierConfig.hbm_rows={self.hbm_rows!r} is invalid",
                    "use an int in 1..2**31-1, or hbm_bytes for one HBM tier shared by all tables",
                )
            return
        for name in ("hbm_bytes", "ddr_bytes"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not (0 if name == "ddr_bytes" else 1) <= v <= 2**50):
                raise ConfigError(f"TierConfig.{name}={v!r} is invalid", "use a number of bytes, up to 2**50")
        if self.hbm_rows or self.ddr_rows:
            raise ConfigError(
                f"TierConfig.hbm_rows={self.hbm_rows!r} / ddr_rows={self.ddr_rows!r} are given with hbm_bytes",
                "size the tiers either in bytes shared by all tables (hbm_bytes, ddr_bytes) or in rows per table",
            )

    def _check_reserved(self) -> None:
        """``reserved``: table names with bytes of each budget, within the budgets."""
        given = self.reserved
        try:
            rows = [(n, *v) for n, v in given.items()] if isinstance(given, dict) else [tuple(e) for e in given]
            entries = sorted(rows)
        except (TypeError, ValueError):
            entries = [()]
        hint = "give reserved={'table': (hbm_bytes, ddr_bytes)}, within hbm_bytes and ddr_bytes"
        for e in entries:
            if len(e) != 3 or not isinstance(e[0], str) or not all(_is_int(v) and 0 <= v <= 2**50 for v in e[1:]):
                raise ConfigError(f"TierConfig.reserved={given!r} is invalid", hint)
        if not entries:
            object.__setattr__(self, "reserved", ())
            return
        if self.hbm_bytes is None:
            raise ConfigError(
                f"TierConfig.reserved={given!r} is given without hbm_bytes",
                "reserve bytes of tiers shared by the tables: give hbm_bytes (and ddr_bytes) too",
            )
        if len({e[0] for e in entries}) < len(entries):
            raise ConfigError(f"TierConfig.reserved={given!r} names a table twice", hint)
        for tier, total, k in (("hbm", self.hbm_bytes, 1), ("ddr", self.ddr_bytes or 0, 2)):
            if sum(e[k] for e in entries) > total:
                raise ConfigError(
                    f"TierConfig.reserved={given!r} sets apart more {tier.upper()} bytes than {tier}_bytes={total}",
                    hint,
                )
        object.__setattr__(self, "reserved", tuple(tuple(e) for e in entries))

    @property
    def shared(self) -> bool:
        """Whether one HBM and one DDR tier hold every table (sized in bytes) but those
        with bytes ``reserved``."""
        return self.hbm_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict of plain values."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
