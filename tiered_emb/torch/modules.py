"""The ``nn.Module`` s over a store's tables: :class:`TieredEmbeddingBag`, :class:`TieredEmbedding`
and :class:`TieredEmbeddingBagCollection` (see :mod:`tiered_emb.torch`)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tiered_emb.errors import ConfigError, IdTypeError
from tiered_emb.torch._base import StoreModule
from tiered_emb.torch._inputs import as_numpy_ids, bags_of, weights_of

_MODES = ("sum", "mean", "max")


def _pretrained_rows(embeddings) -> np.ndarray:
    """float32 (n, dim) rows from a tensor or array, as ``from_pretrained`` takes them."""
    if isinstance(embeddings, torch.Tensor):
        embeddings = embeddings.detach().cpu().numpy()
    rows = np.asarray(embeddings)
    if rows.ndim != 2 or rows.dtype.kind != "f":
        raise ConfigError(
            f"embeddings of shape {rows.shape} and dtype {rows.dtype} are invalid",
            "pass a 2-D float tensor (num_embeddings, dim), as torch's from_pretrained",
        )
    return np.ascontiguousarray(rows, dtype=np.float32)


class TieredEmbeddingBag(StoreModule):
    """Like :class:`torch.nn.EmbeddingBag`, over one table of a :class:`~tiered_emb.TieredStore`.

    Parameters
    ----------
    store : TieredStore
    table : str, a table of ``store``; its optimizer is applied in backward
    mode : ``"mean"`` (default, as torch), ``"sum"`` or ``"max"``
    include_last_offset : bool, as in torch (offsets has B + 1 entries)
    nonfinite : ``"raise"`` (default), ``"skip"`` or ``"zero"``: NaN/inf gradients, as
        :meth:`TieredStore.apply_gradients`
    padding_idx : int or None, as in torch: that id is left out of every bag (its sum, its
        mean's count, its max), gets no gradient and is never read or updated
    freeze : bool, True: no forward plans an update (``per_sample_weights`` still get
        their gradient)
    output_dtype : torch.float32 (default), torch.float16 or torch.bfloat16: the output's
        dtype (as FBGEMM's TBE); rows are pooled in float32, then cast.  A float16 output
        updates the rows through a :class:`tiered_emb.torch.TieredOptimizer` only (its loss
        is scaled: ConfigError for a fused update, as under float16 autocast)

    Notes
    -----
    The rows are updated by the store in backward (fused), or at the step of a
    :class:`tiered_emb.torch.TieredOptimizer` that holds the gradients (needed for
    loss scaling, clipping and gradient accumulation; docs/training.md).  In ``eval()``
    mode and under ``torch.no_grad()`` a forward plans no update.

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
        self,
        store,
        table: str,
        mode: str = "mean",
        include_last_offset: bool = False,
        nonfinite: str = "raise",
        *,
        padding_idx: int | None = None,
        freeze: bool = False,
        output_dtype=torch.float32,
    ):
        if mode not in _MODES:
            raise ConfigError(f"mode={mode!r} is not supported", f"use one of {_MODES}")
        super().__init__(store, table, nonfinite, padding_idx, freeze, output_dtype)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    @classmethod
    def from_pretrained(
        cls,
        embeddings,
        store,
        table: str,
        freeze: bool = True,
        mode: str = "mean",
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        nonfinite: str = "raise",
    ) -> TieredEmbeddingBag:
        """A module over ``table`` whose rows ``0..n-1`` are ``embeddings`` (float (n, dim)),
        written into the store (their optimizer state kept); defaults as torch's."""
        bag = cls(store, table, mode, include_last_offset, nonfinite, padding_idx=padding_idx, freeze=freeze)
        rows = _pretrained_rows(embeddings)
        store.write(table, np.arange(rows.shape[0], dtype=np.int64), rows)
        return bag

    def forward(self, input, offsets=None, per_sample_weights=None) -> torch.Tensor:
        """Pooled rows, float32 (B, dim); ``input`` 1-D with ``offsets``, or 2-D (B, L)."""
        if self.compiles(self.mode, input):
            return self.pool_compiled(input, offsets, per_sample_weights, self.mode, self.include_last_offset)
        # (no copy of the ids where no backward will read them again)
        ids, off, shape = bags_of(input, offsets, self.include_last_offset, copy=torch.is_grad_enabled())
        plan, weights_t = self.plan_batch(ids, off, per_sample_weights, self.mode, shape)
        return self.pool(plan, weights_t, self.mode)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"table={self.table!r}, dim={self.embedding_dim}, mode={self.mode!r}{pad}"


class TieredEmbedding(StoreModule):
    """Like :class:`torch.nn.Embedding` (one row per id, any input shape), over one table.

    ``padding_idx`` as in torch: that id's row is read as it is but gets no gradient and
    no update; ``freeze`` as in :class:`TieredEmbeddingBag`.

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> s = TieredStore.create(tempfile.mkdtemp() + "/s", [TableConfig("t", 4)], TierConfig(16, device="cpu"))
    >>> TieredEmbedding(s, "t")(torch.tensor([[1, 2], [2, 5]])).shape
    torch.Size([2, 2, 4])
    >>> s.close()
    """

    def __init__(
        self, store, table: str, nonfinite: str = "raise", *, padding_idx: int | None = None, freeze: bool = False
    ):
        super().__init__(store, table, nonfinite, padding_idx, freeze)

    @classmethod
    def from_pretrained(
        cls, embeddings, store, table: str, freeze: bool = True, padding_idx: int | None = None, nonfinite="raise"
    ) -> TieredEmbedding:
        """As :meth:`TieredEmbeddingBag.from_pretrained`."""
        emb = cls(store, table, nonfinite, padding_idx=padding_idx, freeze=freeze)
        rows = _pretrained_rows(embeddings)
        store.write(table, np.arange(rows.shape[0], dtype=np.int64), rows)
        return emb

    def forward(self, input) -> torch.Tensor:
        """The rows of ``input``'s ids, float32 ``(*input.shape, dim)``."""
        if self.padding_idx is None and self.compiles("sum", input):
            out = self.pool_compiled(input.reshape(-1, 1), None, None, "sum", False)
            return out.reshape(*input.shape, self.embedding_dim)
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else np.shape(input)  # () for a 0-d index
        flat = as_numpy_ids(input, "input ids").reshape(-1)
        pad = None if self.padding_idx is None else flat == self.padding_idx
        if pad is not None and bool(pad.any()):
            out = self._with_padding(flat, pad)
        else:
            out = self._gathered(flat)
        return out.reshape(*shape, self.embedding_dim)

    def _gathered(self, ids: np.ndarray) -> torch.Tensor:
        # Bags of one id: the pooled path is a gather, with the same fused backward.
        plan, _ = self.plan_batch(ids, np.arange(ids.shape[0] + 1, dtype=np.int64), None, "sum")
        return self.pool(plan, None, "sum")

    def _with_padding(self, ids: np.ndarray, pad: np.ndarray) -> torch.Tensor:
        """The padding row read without a gradient, the others through the update path."""
        self.store.engine.check_ids(self.table, ids)  # every id, before anything is read
        kept = self._gathered(ids[~pad])
        pad_row = torch.from_numpy(self.store.peek(self.table, np.array([self.padding_idx], dtype=np.int64)))
        where = np.where(pad, kept.shape[0], np.cumsum(~pad) - 1)  # row of each position in cat(kept, pad_row)
        # (the rows of a GPU store are a CUDA tensor: the padding row, read on the host, joins them there)
        return torch.cat([kept, pad_row.to(kept.device)])[torch.from_numpy(where).to(kept.device)]

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.embedding_dim}"


class TieredEmbeddingBagCollection(torch.nn.Module):
    """One :class:`TieredEmbeddingBag` per feature, over the tables of one store.

    Parameters
    ----------
    store : TieredStore
    feature_tables : dict feature name -> table name (a list means feature == table)
    mode : ``"sum"`` (default, as torchrec), ``"mean"`` or ``"max"``
    output_dtype : the pooled outputs' dtype, as :class:`TieredEmbeddingBag`'s

    Notes
    -----
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

    def __init__(
        self, store, feature_tables, mode: str = "sum", nonfinite: str = "raise", *, output_dtype=torch.float32
    ):
        super().__init__()
        if not isinstance(feature_tables, dict):
            feature_tables = {f: f for f in feature_tables}
        for f in feature_tables:
            if not isinstance(f, str):
                raise ConfigError(f"feature name {f!r} is a {type(f).__name__}", "name features with str")
        self.feature_tables = dict(feature_tables)
        self.bags = torch.nn.ModuleDict(
            {
                f: TieredEmbeddingBag(store, t, mode=mode, nonfinite=nonfinite, output_dtype=output_dtype)
                for f, t in self.feature_tables.items()
            }
        )

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Pooled rows per feature; see the class docstring for ``features``."""
        jagged = jagged_of(features)
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
            ids, offsets, weights_t = bags[feats[0]] if len(feats) == 1 else joined([bags[f] for f in feats])
            plan, weights_t = bag.plan_batch(ids, offsets, weights_t, bag.mode)
            store = bag.store
            plan = store.engine.check_bags(table, plan)  # the ids' range, before anything is read
            planned.append((bag, plan, weights_t, feats, [bags[f][1].shape[0] - 1 for f in feats]))
        out = {}
        # (each table's victims go down on a helper thread while the next table's rows come up)
        with planned[0][0].store.engine.descents_behind() if len(planned) > 1 else contextlib.nullcontext():
            for bag, plan, weights_t, feats, sizes in planned:
                pooled = bag.pool(plan, weights_t, bag.mode)
                out.update(zip(feats, torch.split(pooled, sizes) if len(feats) > 1 else [pooled], strict=False))
        return {f: out[f] for f in self.bags}


def joined(parts: list[tuple]) -> tuple:
    """``(ids, offsets, weights)`` of several features' bags, one after the other (weights of 1
    for a feature given none, when another has them)."""
    ids = np.concatenate([p[0] for p in parts])
    starts = np.cumsum([0] + [p[0].shape[0] for p in parts[:-1]])
    offsets = np.concatenate([parts[0][1][:1]] + [p[1][1:] + s for p, s in zip(parts, starts, strict=False)])
    if all(p[2] is None for p in parts):
        return ids, offsets, None
    device = next(p[2].device for p in parts if p[2] is not None)  # (CUDA weights: the ones go there too)
    weights = [p[2] if p[2] is not None else torch.ones(p[0].shape[0], device=device) for p in parts]  # each checked
    return ids, offsets, torch.cat([w.reshape(-1).to(torch.float32) for w in weights])


def jagged_of(features) -> dict:
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
