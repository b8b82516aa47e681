"""The ``nn.Module`` s over a store's tables: :class:`TieredEmbeddingBag`, :class:`TieredEmbedding`
and :class:`TieredEmbeddingBagCollection` (see :mod:`tiered_emb.torch`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tiered_emb._args import nonfinite_rule
from tiered_emb.errors import ConfigError, IdTypeError
from tiered_emb.step.plan import BagPlan, plan_bags
from tiered_emb.torch._autograd import Batch, FusedBags, RowsFromStore
from tiered_emb.torch._inputs import as_numpy_ids, bags_of, weights_of

_MODES = ("sum", "mean")


class _StoreModule(torch.nn.Module):
    def __init__(self, store, table: str, nonfinite: str):
        super().__init__()
        store.table_config(table)  # raises UnknownTableError with a hint
        nonfinite_rule(nonfinite)
        self.store = store
        self.table = table
        self.nonfinite = nonfinite
        self.embedding_dim = store.tables[table].dim
        # Not a Parameter: it only makes outputs require grad so autograd calls our backward.
        self._anchor = torch.empty(0, requires_grad=True)

    @staticmethod
    def _needs_backward() -> bool:
        return torch.is_grad_enabled()

    def _pooled(self, ids: np.ndarray, offsets: np.ndarray, weights_t, mode: str, shape=None) -> torch.Tensor:
        """``shape``: the input ids' shape, that of ``weights_t`` (default ``ids.shape``)."""
        return self._run(self._plan(ids, offsets, weights_t, mode, shape), weights_t, mode)

    @staticmethod
    def _plan(ids: np.ndarray, offsets: np.ndarray, weights_t, mode: str, shape=None) -> BagPlan:
        """The batch's bags, checked (offsets, weights); nothing read yet."""
        weights = weights_of(weights_t, ids.shape if shape is None else shape, mode)
        return plan_bags(ids, offsets, weights, mean=(mode == "mean"))

    def _run(self, plan: BagPlan, weights_t, mode: str) -> torch.Tensor:
        """Pooled rows of a checked plan, with the fused backward when grad is enabled."""
        if self.store.xp is not np:
            return self._pooled_device(plan, weights_t, mode)
        batch = Batch(self.store, self.table, plan, self.nonfinite)
        if not self._needs_backward():
            return torch.from_numpy(self.store.lookup_pooled(self.table, plan, backward=False))
        return FusedBags.apply(self._anchor, weights_t, batch)

    def _pooled_device(self, plan: BagPlan, weights_t, mode: str) -> torch.Tensor:
        """GPU HBM: rows by DLPack, pooled by torch on the device; backward through autograd."""
        anchor = self._anchor if self._needs_backward() else self._anchor.detach()
        rows = RowsFromStore.apply(anchor, self.store, self.table, plan.ids, self.nonfinite)
        dev = rows.device
        idx = torch.arange(plan.ids.shape[0], device=dev)
        off = torch.from_numpy(plan.offsets).to(dev)
        w = None if weights_t is None else weights_t.reshape(-1).to(dev)
        return F.embedding_bag(idx, rows, off, mode=mode, per_sample_weights=w, include_last_offset=True)


class TieredEmbeddingBag(_StoreModule):
    """Like :class:`torch.nn.EmbeddingBag`, over one table of a :class:`~tiered_emb.TieredStore`.

    Parameters
    ----------
    store : TieredStore
    table : str, a table of ``store``; its optimizer is applied in backward
    mode : ``"sum"`` or ``"mean"``
    include_last_offset : bool, as in torch (offsets has B + 1 entries)
    nonfinite : ``"raise"`` (default), ``"skip"`` or ``"zero"``: NaN/inf gradients, as
        :meth:`TieredStore.apply_gradients`

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig, SGD
    >>> s = TieredStore.create(tempfile.mkdtemp() + "/s", [TableConfig("t", 4, optimizer=SGD(0.1))],
    ...                        TierConfig(hbm_rows=16, device="cpu"))
    >>> bag = TieredEmbeddingBag(s, "t", mode="mean")
    >>> out = bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    >>> out.shape
    torch.Size([2, 4])
    >>> out.sum().backward()   # rows 1, 2, 3 updated by the store's SGD
    >>> s.close()
    """

    def __init__(
        self, store, table: str, mode: str = "sum", include_last_offset: bool = False, nonfinite: str = "raise"
    ):
        super().__init__(store, table, nonfinite)
        if mode not in _MODES:
            raise ConfigError(f"mode={mode!r} is not supported", f"use one of {_MODES}")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(self, input, offsets=None, per_sample_weights=None) -> torch.Tensor:
        """Pooled rows, float32 (B, dim); ``input`` 1-D with ``offsets``, or 2-D (B, L)."""
        ids, off, shape = bags_of(input, offsets, self.include_last_offset)
        return self._pooled(ids, off, per_sample_weights, self.mode, shape)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.embedding_dim}, mode={self.mode!r}"


class TieredEmbedding(_StoreModule):
    """Like :class:`torch.nn.Embedding` (one row per id, any input shape), over one table.

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> s = TieredStore.create(tempfile.mkdtemp() + "/s", [TableConfig("t", 4)], TierConfig(16, device="cpu"))
    >>> TieredEmbedding(s, "t")(torch.tensor([[1, 2], [2, 5]])).shape
    torch.Size([2, 2, 4])
    >>> s.close()
    """

    def __init__(self, store, table: str, nonfinite: str = "raise"):
        super().__init__(store, table, nonfinite)

    def forward(self, input) -> torch.Tensor:
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else np.shape(input)  # () for a 0-d index
        flat = as_numpy_ids(input, "input ids").reshape(-1)
        # Bags of one id: the pooled path is a gather, with the same fused backward.
        out = self._pooled(flat, np.arange(flat.shape[0] + 1, dtype=np.int64), None, "sum")
        return out.reshape(*shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.embedding_dim}"


class TieredEmbeddingBagCollection(torch.nn.Module):
    """One :class:`TieredEmbeddingBag` per feature, over the tables of one store.

    Parameters
    ----------
    store : TieredStore
    feature_tables : dict feature name -> table name (a list means feature == table)
    mode : ``"sum"`` or ``"mean"``

    ``forward`` takes a dict feature -> ``(values, lengths)`` (values int (n,), lengths int
    (B,) per feature) or, when torchrec is installed, a ``KeyedJaggedTensor``; it returns
    a dict feature -> float32 (B, dim), in the order of ``feature_tables``.

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> s = TieredStore.create(tempfile.mkdtemp() + "/s", [TableConfig("a", 4), TableConfig("b", 8)],
    ...                        TierConfig(16, device="cpu"))
    >>> ebc = TieredEmbeddingBagCollection(s, ["a", "b"])
    >>> a = (torch.tensor([1, 2, 3]), torch.tensor([2, 1]))
    >>> out = ebc({"a": a, "b": (torch.tensor([7, 7]), torch.tensor([1, 1]))})
    >>> {k: tuple(v.shape) for k, v in out.items()}
    {'a': (2, 4), 'b': (2, 8)}
    >>> s.close()
    """

    def __init__(self, store, feature_tables, mode: str = "sum", nonfinite: str = "raise"):
        super().__init__()
        if not isinstance(feature_tables, dict):
            feature_tables = {f: f for f in feature_tables}
        for f in feature_tables:
            if not isinstance(f, str):
                raise ConfigError(f"feature name {f!r} is a {type(f).__name__}", "name features with str")
        self.feature_tables = dict(feature_tables)
        self.bags = torch.nn.ModuleDict(
            {f: TieredEmbeddingBag(store, t, mode=mode, nonfinite=nonfinite) for f, t in self.feature_tables.items()}
        )

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Pooled rows per feature; see the class docstring for ``features``."""
        jagged = _jagged_of(features)
        missing = [f for f in self.feature_tables if f not in jagged]
        if missing:
            raise ConfigError(
                f"features {missing} are missing from the batch", f"give every feature of {list(self.feature_tables)}"
            )
        bags = {}
        for f in self.bags:
            values, lengths, weights = jagged[f]
            lengths = as_numpy_ids(lengths, f"lengths of feature {f!r}")
            if lengths.ndim != 1:
                raise IdTypeError(
                    f"lengths of feature {f!r} have shape {tuple(lengths.shape)}", "pass 1-D lengths, one per bag"
                )
            offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ids = as_numpy_ids(values, f"values of feature {f!r}")
            if ids.ndim != 1:
                raise IdTypeError(f"values of feature {f!r} have shape {tuple(ids.shape)}", "pass 1-D values")
            bags[f] = ids, offsets, weights
        # Features of one table are looked up together, as one batch of bags: one update of
        # each row on the gradient summed over them (as torchrec), not one per feature.
        groups: dict[str, list[str]] = {}
        for f in self.bags:
            groups.setdefault(self.feature_tables[f], []).append(f)
        planned = []
        for table, feats in groups.items():  # every feature checked before any row is read
            bag = self.bags[feats[0]]
            if len(feats) > 1:
                # Checked one by one before they are joined, where one feature's wrong lengths
                # or weights would shift its neighbour's bags instead (plan_bags checks a
                # feature on its own table).
                for f in feats:
                    ids, offsets, weights = bags[f]
                    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != ids.shape[0]:
                        raise IdTypeError(
                            f"lengths of feature {f!r} sum to {int(offsets[-1])} for {ids.shape[0]} "
                            "values, or hold a negative one",
                            "give one length >= 0 per bag, summing to the number of values",
                        )
                    weights_of(weights, ids.shape, bag.mode)
            ids, offsets, weights_t = bags[feats[0]] if len(feats) == 1 else _joined([bags[f] for f in feats])
            plan = bag._plan(ids, offsets, weights_t, bag.mode)
            store = bag.store
            store.check_bags(table, plan)  # the ids' range, before anything is read
            planned.append((bag, plan, weights_t, feats, [bags[f][1].shape[0] - 1 for f in feats]))
        out = {}
        for bag, plan, weights_t, feats, sizes in planned:
            pooled = bag._run(plan, weights_t, bag.mode)
            out.update(zip(feats, torch.split(pooled, sizes) if len(feats) > 1 else [pooled], strict=False))
        return {f: out[f] for f in self.bags}


def _joined(parts: list[tuple]) -> tuple:
    """``(ids, offsets, weights)`` of several features' bags, one after the other (weights of 1
    for a feature given none, when another has them)."""
    ids = np.concatenate([p[0] for p in parts])
    starts = np.cumsum([0] + [p[0].shape[0] for p in parts[:-1]])
    offsets = np.concatenate([parts[0][1][:1]] + [p[1][1:] + s for p, s in zip(parts, starts, strict=False)])
    if all(p[2] is None for p in parts):
        return ids, offsets, None
    weights = [p[2] if p[2] is not None else torch.ones(p[0].shape[0]) for p in parts]  # each checked
    return ids, offsets, torch.cat([w.reshape(-1).to(torch.float32) for w in weights])


def _jagged_of(features) -> dict:
    """feature -> (values, lengths, weights or None) from a dict or a torchrec KeyedJaggedTensor."""
    if isinstance(features, dict):
        out = {}
        for f, v in features.items():
            if not isinstance(v, (tuple, list)) or len(v) not in (2, 3):
                raise ConfigError(
                    f"feature {f!r} is given as {type(v).__name__}",
                    "give (values, lengths) or (values, lengths, weights)",
                )
            out[f] = (v[0], v[1], v[2] if len(v) == 3 else None)
        return out
    if hasattr(features, "to_dict") and hasattr(features, "keys"):  # torchrec KeyedJaggedTensor
        return {f: (jt.values(), jt.lengths(), jt.weights_or_none()) for f, jt in features.to_dict().items()}
    raise ConfigError(
        f"features of type {type(features).__name__} are not supported",
        "pass a dict feature -> (values, lengths) or a torchrec KeyedJaggedTensor",
    )
