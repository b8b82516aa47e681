"""Configuration: frozen dataclasses validated when built.

Every invalid field raises :class:`~tiered_emb.errors.ConfigError` naming the field and
the value given, with a hint.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .errors import ConfigError
from .optimizers import OPTIMIZERS, SGD, optimizer_from_dict, optimizer_to_dict

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
MAX_ID = 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Uniform:
    """Initial weights drawn from ``Uniform(low, high)``."""

    low: float = -0.05
    high: float = 0.05
    name = "uniform"

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ConfigError(f"Uniform(low={self.low!r}, high={self.high!r}) is invalid", "use finite low < high")


@dataclass(frozen=True)
class Normal:
    """Initial weights drawn from ``Normal(mean, std)``."""

    std: float = 0.01
    mean: float = 0.0
    name = "normal"

    def __post_init__(self):
        if not (math.isfinite(self.std) and self.std > 0 and math.isfinite(self.mean)):
            raise ConfigError(f"Normal(std={self.std!r}, mean={self.mean!r}) is invalid", "use a finite std > 0")


INITS = {"uniform": Uniform, "normal": Normal}


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
        ``"float32"`` (reduced precision rows come later).
    init : Uniform | Normal
        Initialiser of rows never written; a pure function of (seed, table, id).
    optimizer : SGD | Adagrad | RowWiseAdagrad | Adam
        Applied by :meth:`TieredStore.apply_gradients`; its state lives in the row.

    Examples
    --------
    >>> TableConfig("user", dim=64, optimizer=RowWiseAdagrad(lr=0.05)).record_width
    65
    """

    name: str
    dim: int
    num_rows: int | None = None
    dtype: str = "float32"
    init: Uniform | Normal = field(default_factory=Uniform)
    optimizer: object = field(default_factory=SGD)

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(f"TableConfig.name={self.name!r} is invalid", "use 1-200 letters, digits, '_', '.' or '-'")
        if not _is_int(self.dim) or not 1 <= self.dim <= 65536:
            raise ConfigError(f"TableConfig.dim={self.dim!r} is invalid", "use an int in 1..65536")
        if self.num_rows is not None and (not _is_int(self.num_rows) or not 1 <= self.num_rows <= MAX_ID):
            raise ConfigError(f"TableConfig.num_rows={self.num_rows!r} is invalid", "use None (unbounded ids) or an int >= 1")
        if self.dtype != "float32":
            raise ConfigError(f"TableConfig.dtype={self.dtype!r} is not supported", "use 'float32'")
        if not isinstance(self.init, (Uniform, Normal)):
            raise ConfigError(f"TableConfig.init={self.init!r} is invalid", "use tiered_emb.Uniform(...) or tiered_emb.Normal(...)")
        if type(self.optimizer) not in OPTIMIZERS.values():
            raise ConfigError(f"TableConfig.optimizer={self.optimizer!r} is invalid",
                              "use SGD, Adagrad, RowWiseAdagrad or Adam from tiered_emb")

    @property
    def state_width(self) -> int:
        return self.optimizer.state_width(self.dim)

    @property
    def record_width(self) -> int:
        """Floats per record: weights then optimizer state."""
        return self.dim + self.state_width

    def to_dict(self) -> dict:
        init = {"name": self.init.name, **{k: getattr(self.init, k) for k in self.init.__dataclass_fields__}}
        return {"name": self.name, "dim": self.dim, "num_rows": self.num_rows, "dtype": self.dtype,
                "init": init, "optimizer": optimizer_to_dict(self.optimizer)}

    @classmethod
    def from_dict(cls, d: dict) -> "TableConfig":
        init = dict(d["init"])
        init_cls = INITS[init.pop("name")]
        return cls(name=d["name"], dim=d["dim"], num_rows=d["num_rows"], dtype=d["dtype"],
                   init=init_cls(**init), optimizer=optimizer_from_dict(d["optimizer"]))


@dataclass(frozen=True)
class TierConfig:
    """Capacities and policy of the cache tiers.

    Parameters
    ----------
    hbm_rows : int
        Rows *per table* held in the HBM tier (CuPy on a GPU, NumPy otherwise); >= 1.
    ddr_rows : int
        Rows per table held in host DDR below HBM; >= 0 (0: HBM misses go to LMDB).
    policy : str
        Eviction policy name from :data:`tiered_emb.policies.POLICIES` (``"lru"``, ``"lfu"``).
    device : str
        ``"auto"`` (CuPy when a GPU is usable, else NumPy with one warning), ``"cpu"`` or ``"cuda"``.
    ssd_compression : int or None
        zstd level (1..22) for LMDB records, or None for raw float32 bytes.
    map_size_bytes : int
        Initial LMDB map size; the map doubles by itself when full.
    background_writes : bool
        Write evicted rows to LMDB on a writer thread (default) instead of the step's; the
        rows stay readable from memory until their transaction commits.
    """

    hbm_rows: int
    ddr_rows: int = 0
    policy: str = "lru"
    device: str = "auto"
    ssd_compression: int | None = None
    map_size_bytes: int = 1 << 28
    background_writes: bool = True

    def __post_init__(self):
        from .policies import POLICIES

        if not _is_int(self.hbm_rows) or self.hbm_rows < 1 or self.hbm_rows > 2**31 - 1:
            raise ConfigError(f"TierConfig.hbm_rows={self.hbm_rows!r} is invalid", "use an int in 1..2**31-1")
        if not _is_int(self.ddr_rows) or self.ddr_rows < 0 or self.ddr_rows > 2**31 - 1:
            raise ConfigError(f"TierConfig.ddr_rows={self.ddr_rows!r} is invalid", "use an int in 0..2**31-1")
        if self.policy not in POLICIES:
            raise ConfigError(f"TierConfig.policy={self.policy!r} is unknown", f"use one of {sorted(POLICIES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"TierConfig.device={self.device!r} is invalid", "use 'auto', 'cpu' or 'cuda'")
        if self.ssd_compression is not None and (not _is_int(self.ssd_compression) or not 1 <= self.ssd_compression <= 22):
            raise ConfigError(f"TierConfig.ssd_compression={self.ssd_compression!r} is invalid",
                              "use None (no compression) or a zstd level in 1..22")
        if not _is_int(self.map_size_bytes) or self.map_size_bytes < (1 << 20):
            raise ConfigError(f"TierConfig.map_size_bytes={self.map_size_bytes!r} is invalid", "use an int >= 1 MiB")
        if not isinstance(self.background_writes, bool):
            raise ConfigError(f"TierConfig.background_writes={self.background_writes!r} is invalid", "use True or False")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
