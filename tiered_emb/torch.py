"""PyTorch front end: ``nn.Module`` s over a :class:`~tiered_emb.TieredStore` (the only module importing torch).

The embedding rows never become torch parameters.  A forward reads them from the
store; the backward hands their gradients to the store, whose optimizer (the table's
``TableConfig.optimizer``) updates each touched row once, in place, in the HBM tier:
a *fused* backward, with no dense gradient and no torch optimizer for the embeddings.
Dense parameters of the surrounding model keep their torch optimizer as usual::

    emb = TieredEmbeddingBag(store, "user", mode="sum")
    out = mlp(emb(ids, offsets))          # (B, dim) pooled rows from the store
    loss.backward()                       # embedding rows updated here, by the store
    dense_opt.step()                      # the MLP's own optimizer

With the NumPy HBM tier (no GPU), the forward pools straight from the HBM slots and the
backward reduces the bags' gradients per unique id (:mod:`tiered_emb.step.reduce`); the
output is a zero-copy ``torch.from_numpy`` view.  With a CuPy HBM tier the rows cross
into torch by DLPack (no copy) and torch pools them on the GPU.

A forward with gradients enabled plans one backward (kept in the autograd graph, freed
with it); under ``torch.no_grad()`` it is a plain read.  As with any in-place update,
run a batch's backward before the rows it read are updated by another batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from tiered_emb._args import nonfinite_rule
from tiered_emb.errors import BackwardError, ConfigError, DeviceError, IdRangeError, IdTypeError
from tiered_emb.prefetch import lookahead
from tiered_emb.step.plan import BagPlan, plan_bags

_MODES = ("sum", "mean")
_MAX_INT64 = 2**63 - 1


def _no_data(x, what: str) -> None:
    """A tensor on the ``meta`` device has a shape but no values to read."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        raise DeviceError(
            f"{what} are on the 'meta' device, which holds no data", "pass tensors with values (on the CPU or the GPU)"
        )


def _as_numpy_ids(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        _no_data(x, what)
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise IdTypeError(f"{what} have dtype {x.dtype}", "pass integer ids (torch.long)")
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        a = x.numpy()
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise IdTypeError(f"{what} have dtype {a.dtype}", "pass integer ids")
    if a.dtype == np.uint64 and a.size and int(a.max()) > _MAX_INT64:  # would wrap to a negative int64
        raise IdRangeError(f"{what} hold {int(a.max())}, beyond int64", f"ids are int64 in [0, {_MAX_INT64}]")
    # A copy, never a view of the caller's tensor: the backward reads the batch again, and
    # an input changed in place after the forward must not change the update.
    return np.array(a, dtype=np.int64, order="C", copy=True)


def _bags_of(input, offsets, include_last_offset: bool) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``(ids (n,), offsets (B+1,), the input's shape)`` from torch.nn.EmbeddingBag's input conventions."""
    ids = _as_numpy_ids(input, "input ids")
    shape = tuple(ids.shape)
    if ids.ndim == 2:
        if offsets is not None:
            raise ConfigError("offsets were given with a 2-D input", "pass offsets=None for 2-D (B, L) input")
        b, length = ids.shape
        return ids.reshape(-1), np.arange(b + 1, dtype=np.int64) * length, shape
    if ids.ndim != 1:
        raise IdTypeError(f"input ids have shape {tuple(ids.shape)}", "pass 1-D ids with offsets, or 2-D (B, L) ids")
    if offsets is None:
        raise ConfigError("a 1-D input needs offsets", "pass offsets (int64, one start per bag), or a 2-D input")
    off = _as_numpy_ids(offsets, "offsets")
    if off.ndim != 1:
        raise IdTypeError(f"offsets have shape {tuple(off.shape)}", "pass 1-D offsets")
    if not include_last_offset:
        off = np.concatenate([off, np.array([ids.shape[0]], dtype=np.int64)])
    return ids, off, shape


def _weights_of(per_sample_weights, shape: tuple, mode: str):
    """float32 (n,) weights from ``per_sample_weights``, a tensor of the ids' ``shape`` (as in torch)."""
    if per_sample_weights is None:
        return None
    if mode != "sum":
        raise ConfigError(f"per_sample_weights with mode={mode!r}", "per_sample_weights need mode='sum' (as in torch)")
    w = per_sample_weights
    if not isinstance(w, torch.Tensor):
        raise ConfigError(
            f"per_sample_weights of type {type(w).__name__} are invalid",
            "pass a float tensor (torch.as_tensor(w, dtype=torch.float32)), as torch.nn.EmbeddingBag",
        )
    _no_data(w, "per_sample_weights")
    if w.is_complex():  # its imaginary part would be dropped
        raise ConfigError(f"per_sample_weights have dtype {w.dtype}", "pass real weights (torch.float32)")
    if tuple(w.shape) != tuple(shape):
        raise ConfigError(
            f"per_sample_weights have shape {tuple(w.shape)} for input ids of shape {tuple(shape)}",
            "give one weight per id, in the input's shape (as torch.nn.EmbeddingBag)",
        )
    w = w.detach().reshape(-1)
    return np.array(w.cpu().numpy(), dtype=np.float32, order="C", copy=True)  # a copy: see _as_numpy_ids


def _after_backward(update, ctx, spent: tuple[str, ...]) -> None:
    """Run ``update`` (a table's checked and reduced gradient step) once the whole backward
    pass has succeeded, not now; then clear the ``spent`` attributes of ``ctx``, the first of
    which marks the update as applied (a second backward through it raises :class:`BackwardError`).

    Why: autograd calls each table's backward on its own, so a backward through several
    tables whose gradient for one holds NaN (``nonfinite="raise"``) updated the tables
    before it and raised at that one: half a step, which a caller who skips the batch
    could not undo.  Each backward checks its gradient at once (the error stops the pass)
    and queues its update on the autograd engine, which runs the queued callbacks, in
    order, only at the end of a pass that raised nothing: every table or none.  The checks
    include a failed write-back left by an earlier operation (a full disk), and the queued
    updates leave one met among them to the next operation, so that failure too stops the
    pass before any table changes.
    """

    def run() -> None:
        update()
        for name in spent:
            setattr(ctx, name, None)

    torch.autograd.Variable._execution_engine.queue_callback(run)


class _Batch:
    """One forward's plan, kept for its backward."""

    def __init__(self, store, table: str, plan: BagPlan, nonfinite: str):
        self.store, self.table, self.plan, self.nonfinite = store, table, plan, nonfinite


class _FusedBags(torch.autograd.Function):
    """Pooled rows from the store; backward = the store's optimizer (host NumPy HBM)."""

    @staticmethod
    def forward(ctx, anchor, weights_t, batch: _Batch):
        out = batch.store.lookup_pooled(batch.table, batch.plan)
        ctx.batch = batch
        ctx.weights_need_grad = weights_t is not None and weights_t.requires_grad
        if ctx.weights_need_grad:
            ctx.weights_shape, ctx.weights_device = weights_t.shape, weights_t.device
            # d out[b] / d w_i = row_i: rows as read now (before the backward updates them).
            ctx.rows = batch.store.peek(batch.table, batch.plan.ids)
        return torch.from_numpy(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        batch = ctx.batch
        if batch is None:
            raise BackwardError(
                "a second backward through an embedding output whose update the store already "
                "applied (backward(retain_graph=True), then another backward)",
                "sum the losses and call backward once; the store applies its optimizer in backward",
            )
        g = np.ascontiguousarray(grad_out.detach().cpu().numpy(), dtype=np.float32)
        grad_w = None
        if ctx.weights_need_grad:
            plan = batch.plan
            bag_of = np.repeat(np.arange(plan.num_bags), np.diff(plan.offsets))
            grad_w = torch.from_numpy(np.einsum("nd,nd->n", ctx.rows, g[bag_of]).astype(np.float32))
            grad_w = grad_w.reshape(ctx.weights_shape).to(ctx.weights_device)  # the weights' own shape: (n,) or (B, L)
        # ctx.rows go with the update: a pass that fails leaves them for the backward run again
        _after_backward(batch.store.pooled_update(batch.table, batch.plan, g, batch.nonfinite), ctx, ("batch", "rows"))
        return None, grad_w, None


class _RowsFromStore(torch.autograd.Function):
    """Rows of ``ids`` as a tensor (DLPack view); backward hands their gradient to the store."""

    @staticmethod
    def forward(ctx, anchor, store, table: str, ids: np.ndarray, nonfinite: str):
        rows = store.lookup(table, ids)
        ctx.args = (store, table, ids, nonfinite)
        return torch.from_dlpack(rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        if ctx.args is None:
            raise BackwardError(
                "a second backward through embedding rows whose update the store already applied",
                "sum the losses and call backward once; the store applies its optimizer in backward",
            )
        store, table, ids, nonfinite = ctx.args
        g = grad_rows.detach().contiguous()
        g = g.cpu().numpy() if store.xp is np else store.xp.from_dlpack(g)
        _after_backward(store.gradient_update(table, ids, g, nonfinite=nonfinite), ctx, ("args",))
        return None, None, None, None, None


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
        weights = _weights_of(weights_t, ids.shape if shape is None else shape, mode)
        return plan_bags(ids, offsets, weights, mean=(mode == "mean"))

    def _run(self, plan: BagPlan, weights_t, mode: str) -> torch.Tensor:
        """Pooled rows of a checked plan, with the fused backward when grad is enabled."""
        if self.store.xp is not np:
            return self._pooled_device(plan, weights_t, mode)
        batch = _Batch(self.store, self.table, plan, self.nonfinite)
        if not self._needs_backward():
            return torch.from_numpy(self.store.lookup_pooled(self.table, plan, backward=False))
        return _FusedBags.apply(self._anchor, weights_t, batch)

    def _pooled_device(self, plan: BagPlan, weights_t, mode: str) -> torch.Tensor:
        """GPU HBM: rows by DLPack, pooled by torch on the device; backward through autograd."""
        anchor = self._anchor if self._needs_backward() else self._anchor.detach()
        rows = _RowsFromStore.apply(anchor, self.store, self.table, plan.ids, self.nonfinite)
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
        ids, off, shape = _bags_of(input, offsets, self.include_last_offset)
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
        flat = _as_numpy_ids(input, "input ids").reshape(-1)
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
            lengths = _as_numpy_ids(lengths, f"lengths of feature {f!r}")
            if lengths.ndim != 1:
                raise IdTypeError(
                    f"lengths of feature {f!r} have shape {tuple(lengths.shape)}", "pass 1-D lengths, one per bag"
                )
            offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ids = _as_numpy_ids(values, f"values of feature {f!r}")
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
                    _weights_of(weights, ids.shape, bag.mode)
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


__all__ = ["TieredEmbedding", "TieredEmbeddingBag", "TieredEmbeddingBagCollection", "TrainPipeline"]


class TrainPipeline:
    """A training loop with lookahead: batches t+1..t+k are in the store's window while batch t trains.

    Wraps a data iterator; before step t it hands the ids of batch t + k to the store
    (:meth:`TieredStore.prefetch`, ``k = lookahead_batches``), whose background thread
    reads the LMDB rows of batch t + ``read_ahead`` (and, with ``load_ahead``, brings the
    rows of batch t + ``load_ahead`` up and pins them) while this thread runs the step
    (see :func:`tiered_emb.prefetch.lookahead`).  Each step runs ``optimizer.zero_grad()``, the loss,
    ``backward()`` (the embedding rows are updated by the store, fused) and
    ``optimizer.step()``, then unpins the batch.  Results are bitwise the same for every
    ``lookahead_batches``, 0 included (no prefetch).

    Parameters
    ----------
    store : TieredStore
    model : torch.nn.Module, holding Tiered* embedding modules over ``store``
    optimizer : torch.optim.Optimizer for the dense parameters (or None)
    ids_of : callable, ``ids_of(batch) -> {table: ids}``: the rows a batch will read
    loss_of : callable, ``loss_of(model, batch) -> scalar loss tensor``
    lookahead_batches : int >= 0, the window k
    load_ahead : int >= 0, batches ahead whose rows are brought up into HBM and pinned (at most k;
        default 1: each step then finds all its rows pinned for it and pools and updates them
        without the store's lock, while the thread places the next batch's; 0: the step
        places its own rows, the window only protects those already up)
    read_ahead : int >= 0, batches ahead whose LMDB rows are read into host memory (at most k; default 0:
        it pays where LMDB reads wait on the disk, not where they are CPU work on a busy host)
    step_threads : int >= 1 or None (default: leave torch's and Numba's settings alone), the threads
        of torch and Numba for the step from ``run``'s first batch until it ends or is
        closed (so also for the caller's code between its yields; torch's setting is the
        process's).  Fewer threads than cores leave
        the background thread a core of its own: on 2 cores, 1 made the DLRM job ~1.1x
        faster (docs/benchmarks.md).  Not the default because torch's dense kernels may sum in
        another order on another thread count, so the dense model (and, through its
        gradients, the rows) would differ from a run without the pipeline; the store's own
        results never depend on it.

    Examples
    --------
    >>> pipe = TrainPipeline(store, model, opt, lambda b: {"item": b[0]},  # doctest: +SKIP
    ...                      lambda m, b: loss_fn(m(b[0], b[1]), b[2]), lookahead_batches=4)
    >>> for loss in pipe.run(loader):  # doctest: +SKIP
    ...     pass
    """

    def __init__(
        self,
        store,
        model,
        optimizer,
        ids_of,
        loss_of,
        lookahead_batches: int = 4,
        load_ahead: int = 1,
        read_ahead: int = 0,
        step_threads: int | None = None,
    ):
        for name, v in (
            ("lookahead_batches", lookahead_batches),
            ("load_ahead", load_ahead),
            ("read_ahead", read_ahead),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name}={v!r} is invalid", "use an int >= 0 (lookahead_batches 0: no prefetch)")
        if step_threads is not None and (
            not isinstance(step_threads, int) or isinstance(step_threads, bool) or step_threads < 1
        ):
            raise ConfigError(f"step_threads={step_threads!r} is invalid", "use an int >= 1, or None")
        self.step_threads = step_threads
        self.store = store
        self.model = model
        self.optimizer = optimizer
        self.ids_of = ids_of
        self.loss_of = loss_of
        self.lookahead_batches = lookahead_batches
        self.load_ahead = load_ahead
        self.read_ahead = read_ahead

    def run(self, batches):
        """Train on every batch of ``batches``; yields each step's loss (a float).

        Stopping early (``break``) releases every pin; the store's thread ends at ``close()``.
        """
        with _step_threads(self.step_threads):
            for batch in lookahead(
                self.store, batches, self.ids_of, self.lookahead_batches, self.load_ahead, self.read_ahead
            ):
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss_of(self.model, batch)
                loss.backward()
                if self.optimizer is not None:
                    self.optimizer.step()
                yield float(loss.detach())


@contextmanager
def _step_threads(n: int | None):
    """torch's and (this thread's) Numba's thread counts set to ``n`` inside, restored after."""
    if n is None:
        yield
        return
    import numba

    before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])
