"""What every torch module over one table shares: when a forward plans an update and where the
update goes, padding, the ``weight`` view of a small table, and the refusals (copying,
pickling, DistributedDataParallel) that keep a training run from going silently wrong."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from tiered_emb._args import nonfinite_rule
from tiered_emb.engine import BagPlan, Engine
from tiered_emb.errors import ConfigError, CopyError, DistributedError, StaleRowsWarning
from tiered_emb.torch import compiled
from tiered_emb.torch._autograd import FUSED, Batch, FusedBags, RowsFromStore, as_tensor
from tiered_emb.torch._inputs import weights_of

#: The largest table ``weight`` reads whole (bytes of float32 rows); read more with ``store.peek``.
WEIGHT_READ_LIMIT_BYTES = 64 << 20
_EXTRA_STATE = "_extra_state"  # torch's key for get_extra_state() in a state_dict


def _ddp_wraps_a_forward() -> bool:
    """Whether this forward runs inside ``DistributedDataParallel.forward``."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    return ddp is not None and ddp._get_active_ddp_module() is not None


#: the forward's output dtypes (FBGEMM's TBE ``output_dtype``: FP32, FP16, BF16)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class StoreModule(torch.nn.Module):
    """Base of the modules over one table of a store (see :class:`TieredEmbeddingBag`)."""

    def __init__(
        self,
        store,
        table: str,
        nonfinite: str,
        padding_idx: int | None = None,
        freeze: bool = False,
        output_dtype=torch.float32,
    ):
        super().__init__()
        store.engine.table_config(table)  # raises UnknownTableError with a hint
        nonfinite_rule(nonfinite)
        if output_dtype not in OUTPUT_DTYPES:
            raise ConfigError(
                f"output_dtype={output_dtype!r} is not supported",
                "use torch.float32, torch.float16 or torch.bfloat16 (rows are pooled in float32, then cast)",
            )
        #: the dtype of the forward's output (as FBGEMM's TBE ``output_dtype``); pooled in float32
        self.output_dtype = output_dtype
        self.store = store
        self.table = table
        self.nonfinite = nonfinite
        self.embedding_dim = store.tables[table].dim
        self.padding_idx = self._padding(padding_idx)
        #: True: forwards plan no update (as a frozen ``nn.EmbeddingBag.from_pretrained``).
        self.freeze = bool(freeze)
        # Not a Parameter: it only makes outputs require grad so autograd calls our backward.
        self._anchor = torch.empty(0, requires_grad=True)
        self._hold = FUSED  # or a TieredOptimizer's held gradients (defer_updates)
        self._handle = compiled.register(self)  # how the compiled forward's ops find this module
        self._compiles = store.engine.xp is np  # the ops pool on the host
        self.register_load_state_dict_pre_hook(_accept_a_state_without_reference)

    @property
    def num_embeddings(self) -> int | None:
        """The table's ``num_rows`` (None for a table of unbounded ids)."""
        return self.store.tables[self.table].num_rows

    def _padding(self, padding_idx) -> int | None:
        if padding_idx is None:
            return None
        n = self.num_embeddings
        if not isinstance(padding_idx, (int, np.integer)) or isinstance(padding_idx, bool):
            raise ConfigError(f"padding_idx={padding_idx!r} is invalid", "use an int id, or None")
        pad = int(padding_idx)
        if pad < 0 and n is None:
            raise ConfigError(
                f"padding_idx={pad} is negative for table {self.table!r} of unbounded ids",
                "give the padding id itself (>= 0), or bound the table (TableConfig.num_rows)",
            )
        if n is not None and not -n <= pad < n:
            raise ConfigError(f"padding_idx={pad} is out of range for {n} rows", f"use an id in [-{n}, {n})")
        return pad + n if pad < 0 and n is not None else pad

    def defer_updates(self, hold) -> None:
        """Hand each backward's gradient to ``hold`` instead of updating the rows at its end
        (:class:`tiered_emb.torch.TieredOptimizer` calls this: the last one built over a module
        holds its updates); ``None`` restores the fused update."""
        self._hold = FUSED if hold is None else hold

    def updates_rows(self) -> bool:
        """Whether a forward now plans an update: gradients enabled, training mode, not frozen."""
        return torch.is_grad_enabled() and self.training and not self.freeze

    @property
    def update_target(self):
        """Where a planned update goes: ``_autograd.FUSED`` or a TieredOptimizer's held gradients."""
        return self._hold

    def check_not_distributed(self) -> None:
        """Raise DistributedError inside ``DistributedDataParallel`` (each rank would update its own rows)."""
        if _ddp_wraps_a_forward():
            raise DistributedError(
                f"the module over table {self.table!r} runs inside DistributedDataParallel, which "
                "all-reduces torch parameters only: each process would update its own copy of the rows",
                "shard the tables over the ranks with tiered_emb.distributed.ShardedEmbeddingBagCollection "
                "and wrap only the dense layers in DDP (docs/distributed.md), or train in one process",
            )

    @staticmethod
    def float16_autocast() -> str:
        """The device type (``"cpu"``, ``"cuda"``) a float16 autocast is on for, or ``""``."""
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
                return device
        return ""

    def check_scaled(self, updates: bool | None = None, autocast: str | None = None) -> None:
        """Raise ConfigError for a forward under float16 autocast whose backward would update
        the rows itself: float16 training scales its loss (``GradScaler``), and the fused
        update would apply the scaled gradient.  A :class:`TieredOptimizer` unscales it.
        ``updates``: whether the forward plans an update (default: :meth:`updates_rows`);
        ``autocast``: :meth:`float16_autocast` as it was when the forward was traced (a compiled
        graph may run its ops with autocast off), by default as it is now."""
        if self._hold is not FUSED or not (self.updates_rows() if updates is None else updates):
            return
        device = self.float16_autocast() if autocast is None else autocast
        if self.output_dtype is torch.float16:
            device = device or "output_dtype=torch.float16"
        if device:
            raise ConfigError(
                f"the module over table {self.table!r} runs under float16 autocast or output ({device}) "
                "and would update its rows in the backward with the gradient it gets: under a "
                "GradScaler, the scaled one (the rows would move scale times too far)",
                "build a tiered_emb.torch.TieredOptimizer(model, dense_optimizer) and step it "
                "through the scaler (scaler.step(opt)): it applies the unscaled gradient, and "
                "skips the rows' update with the step the scaler skips (docs/faq.md)",
            )

    # ------------------------------------------------------------------ the forward
    def plan_batch(self, ids: np.ndarray, offsets: np.ndarray, weights_t, mode: str, shape=None):
        """The batch's bags, checked (offsets, weights), without its padding ids; nothing read yet.

        Returns ``(plan, weights_t)``: the weights too lose the padding positions (by torch
        indexing, so those positions get a zero gradient, as in torch).
        """
        shape = ids.shape if shape is None else shape
        plan = Engine.plan_bags(ids, offsets, weights_of(weights_t, shape, mode), mean=(mode == "mean"))
        if self.padding_idx is None:
            return plan, weights_t
        keep = ids != self.padding_idx
        if bool(keep.all()):
            return plan, weights_t
        kept = np.zeros(ids.shape[0] + 1, dtype=np.int64)
        np.cumsum(keep, out=kept[1:])
        if weights_t is not None:
            weights_t = weights_t.reshape(-1)[torch.from_numpy(keep).to(weights_t.device)]
        w = weights_of(weights_t, (int(kept[-1]),), mode)
        return Engine.plan_bags(ids[keep], kept[plan.offsets], w, mean=(mode == "mean")), weights_t

    def pool(self, plan: BagPlan, weights_t, mode: str) -> torch.Tensor:
        """Pooled rows of a checked plan, float32 (B, dim), with the update planned when
        :meth:`updates_rows`."""
        self.check_not_distributed()
        self.check_scaled()
        hold = self._hold if self.updates_rows() else None
        batch = Batch(self.store, self.table, plan, self.nonfinite, hold)
        if mode == "max":
            return self.cast(self._pooled_rows(batch, weights_t, mode))
        weights_grad = weights_t is not None and weights_t.requires_grad and torch.is_grad_enabled()
        if hold is None and not weights_grad:
            return self.cast(as_tensor(self.store.engine.lookup_pooled(self.table, plan, backward=False)[0]))
        return self.cast(FusedBags.apply(self._anchor, weights_t, batch))

    def cast(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (float32) in :attr:`output_dtype` (its gradient comes back as float32)."""
        return out if self.output_dtype is torch.float32 else out.to(self.output_dtype)

    def compiles(self, mode: str, input) -> bool:
        """Whether this forward, being compiled, is one custom op (see :mod:`tiered_emb.torch.compiled`)."""
        return self._compiles and mode != "max" and isinstance(input, torch.Tensor) and torch.compiler.is_compiling()

    def pool_compiled(self, input, offsets, weights, mode: str, include_last_offset: bool) -> torch.Tensor:
        """The forward under ``torch.compile``: ``tiered_emb::pooled`` on the input tensors.

        The autocast is read while Dynamo traces (it recompiles when the autocast changes) and
        checked by the op when it runs (:meth:`check_scaled`): an error raised while Dynamo
        traces reaches the caller as Dynamo's own, its message and hint lost, and a graph
        compiled by inductor runs its ops with autocast off."""
        update = self.updates_rows()
        anchor = self._anchor if update else self._anchor.detach()
        autocast = self.float16_autocast()
        return self.cast(
            compiled.pooled(input, offsets, weights, anchor, self._handle, mode, include_last_offset, update, autocast)
        )

    def _pooled_rows(self, batch: Batch, weights_t, mode: str) -> torch.Tensor:
        """Rows gathered (by DLPack from a GPU HBM), pooled by torch: ``max``."""
        anchor = self._anchor if batch.hold is not None else self._anchor.detach()
        rows = RowsFromStore.apply(anchor, batch)
        dev = rows.device
        idx = torch.arange(batch.plan.ids.shape[0], device=dev)
        off = torch.from_numpy(batch.plan.offsets).to(dev)
        w = None if weights_t is None else weights_t.reshape(-1).to(dev)
        return F.embedding_bag(idx, rows, off, mode=mode, per_sample_weights=w, include_last_offset=True)

    # ------------------------------------------------------------------ reading the table
    @property
    def weight(self) -> torch.Tensor:
        """Every row of a small table, float32 (num_embeddings, dim): a read-only copy.

        Read from the store (:meth:`TieredStore.peek`, touching no cache state); an inference
        tensor, so writing into it (``nn.init``, ``weight.data.copy_``) raises instead of
        changing a copy.  Write rows with ``store.write`` or :meth:`from_pretrained`.  Tables of
        unbounded ids or over ``WEIGHT_READ_LIMIT_BYTES`` are refused: read the ids you need
        with ``store.peek(table, ids)``.
        """
        n = self.num_embeddings
        if n is None or n * self.embedding_dim * 4 > WEIGHT_READ_LIMIT_BYTES:
            size = "unbounded ids" if n is None else f"{n} rows x {self.embedding_dim}"
            raise ConfigError(
                f"weight of table {self.table!r} ({size}) is too large to read whole",
                f"read the rows you need with store.peek({self.table!r}, ids) "
                f"(weight reads at most {WEIGHT_READ_LIMIT_BYTES >> 20} MiB)",
            )
        rows = self.store.peek(self.table, np.arange(n, dtype=np.int64))
        with torch.inference_mode():
            return torch.from_numpy(rows)

    # ------------------------------------------------------------------ saving and copying
    def _refuse_copy(self, what: str) -> CopyError:
        return CopyError(
            f"{type(self).__name__} over table {self.table!r} cannot be {what}: its rows live in the "
            f"store at {str(self.store.engine.path)!r}, not in the module",
            "save a model with tiered_emb.torch.save(model, optimizer) (a store checkpoint holding the "
            "dense state_dict) and restore it with tiered_emb.torch.load; to share the rows, build "
            "another module over the same store",
        )

    def __reduce_ex__(self, protocol):
        raise self._refuse_copy("pickled (torch.save(model), pickle, multiprocessing)")

    def __deepcopy__(self, memo):
        raise self._refuse_copy("deep-copied")

    def get_extra_state(self) -> dict:
        """A state_dict's reference to the rows (the module holds none): the store, the table
        and the store's checkpoint count when the state was taken."""
        return {
            "rows": "in the store",
            "store": str(self.store.engine.path),
            "table": self.table,
            "dim": self.embedding_dim,
            "checkpoint": self.store.epoch,
        }

    def set_extra_state(self, state) -> None:
        """Check a loaded reference: the same table and dim; warn when the store is older."""
        if state is None:  # a state_dict saved before it carried a reference
            return
        if not isinstance(state, dict) or (state.get("table"), state.get("dim")) != (self.table, self.embedding_dim):
            got = (state.get("table"), state.get("dim")) if isinstance(state, dict) else state
            raise ConfigError(
                f"a state_dict for table/dim {got!r} is loaded into a module over {(self.table, self.embedding_dim)!r}",
                "load the state_dict into the model it was taken from",
            )
        if int(state.get("checkpoint", 0)) > self.store.epoch:
            warnings.warn(
                StaleRowsWarning(
                    f"the state_dict was taken at checkpoint {state['checkpoint']} of store {state['store']!r}; "
                    f"store {str(self.store.engine.path)!r} of table {self.table!r} is at checkpoint "
                    f"{self.store.epoch}, "
                    "so its rows are older than the dense weights loaded with them"
                ),
                stacklevel=2,
            )


def _accept_a_state_without_reference(module, state_dict, prefix, *args) -> None:
    """state_dicts saved before they held the rows' reference load as they did."""
    state_dict.setdefault(prefix + _EXTRA_STATE, None)


def stores_of(model: torch.nn.Module) -> list:
    """The stores under the tiered modules of ``model``, each once, in module order."""
    stores: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, StoreModule):
            stores.setdefault(id(m.store), m.store)
    return list(stores.values())
