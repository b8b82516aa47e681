"""The embedding update held for a step: :class:`TieredOptimizer`, for loss scaling, gradient
clipping and gradient accumulation.

By default the store applies a table's optimizer at the end of the backward pass (fused),
which leaves nothing for ``GradScaler`` to unscale or skip and nothing for
``clip_grad_norm_`` to see.  A :class:`TieredOptimizer` switches the model's tiered
modules to held updates: each backward sums the gradient of every row it touched (per
table, across backwards, as torch sums a parameter's ``.grad``), and :meth:`~TieredOptimizer.step`
hands the sums to the store's optimizer, one update per row.  The sums are exposed to
torch as the ``.grad`` of tensors in :attr:`~TieredOptimizer.param_groups`, so the
scaler unscales them and checks them for inf/NaN, and clipping scales them, in place,
with the dense gradients.
"""

from __future__ import annotations

import numpy as np
import torch

from tiered_emb.errors import ConfigError
from tiered_emb.torch._base import StoreModule


class _Held:
    """One table's gradient since the last step: unique ids (k,) and a tensor whose ``.grad``
    is their summed gradient, float32 (k, dim)."""

    def __init__(self, store, table: str, nonfinite: str, ids: np.ndarray, grads: np.ndarray):
        self.store, self.table, self.nonfinite = store, table, nonfinite
        self._hold(ids, grads)

    def _hold(self, ids: np.ndarray, grads: np.ndarray) -> None:
        self.ids = ids
        # A stand-in for the rows (no memory of its own): torch's utilities read ``.grad``.
        self.tensor = torch.zeros(()).expand(ids.shape[0], grads.shape[1])
        self.tensor.grad = torch.from_numpy(grads)

    def add(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Add another backward's gradient: sums per id, in the order they came."""
        now = self.tensor.grad
        if now is None:  # set to None by the caller: nothing held
            uids, summed = ids, grads
        else:
            old = np.ascontiguousarray(now.detach().cpu().numpy(), dtype=np.float32)
            uids, summed = self.store.engine.reduce_rows(np.concatenate([self.ids, ids]), np.concatenate([old, grads]))
        self._hold(uids, summed)


class HeldGradients:
    """The gradients held for the next step, per (store, table), in the order first met."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, str], _Held] = {}

    def add(self, store, table: str, ids: np.ndarray, grads: np.ndarray, nonfinite: str) -> None:
        """Called at the end of a backward pass that raised nothing (see ``_autograd.hand_over``)."""
        key = (id(store), table)
        if key in self.tables:
            self.tables[key].add(ids, grads)
        else:
            self.tables[key] = _Held(store, table, nonfinite, ids, np.ascontiguousarray(grads, dtype=np.float32))

    def tensors(self) -> list[torch.Tensor]:
        return [h.tensor for h in self.tables.values()]

    def checked_updates(self) -> list:
        """Each table's update, checked (the table's ``nonfinite`` rule) before any is applied."""
        updates = []
        for h in self.tables.values():
            g = h.tensor.grad
            if g is None:
                continue
            grads = np.ascontiguousarray(g.detach().cpu().numpy(), dtype=np.float32)
            updates.append(h.store.engine.gradient_update(h.table, h.ids, grads, nonfinite=h.nonfinite))
        return updates

    def clear(self) -> None:
        self.tables = {}


class TieredOptimizer(torch.optim.Optimizer):
    """The update of a model's tiered tables held until :meth:`step`, beside its dense optimizer.

    Built over ``model``, it switches every tiered module in it to held updates (see the
    module docstring; a TieredOptimizer built later over the same modules takes them over,
    and :meth:`release` gives them back the fused update).  With ``dense`` (the torch
    optimizer of the dense parameters) it is *one* optimizer for the whole model, so that
    ``GradScaler`` and clipping treat both alike: ``scaler.step(opt)`` unscales the dense
    and the embedding gradients together and skips the whole step, rows included, when
    any of them holds inf or NaN.

    It is a ``torch.optim.Optimizer``: :attr:`param_groups` holds the dense optimizer's
    groups (the same dicts), then one group per table with its ``"lr"`` (and ``"table"``,
    its name), so a torch ``lr_scheduler`` (``StepLR``, ``CosineAnnealingLR``, ``LambdaLR``,
    ``SequentialLR``, ...) drives the rows' learning rate as it drives the dense one:
    :meth:`step` hands each table's ``lr`` to the store
    (:meth:`~tiered_emb.TieredStore.set_learning_rate`) before it updates the rows.

    Parameters
    ----------
    model : torch.nn.Module holding Tiered* modules (at least one)
    dense : torch.optim.Optimizer or None, the optimizer of the dense parameters

    Notes
    -----
    Semantics: gradients add up over backwards until :meth:`zero_grad` (gradient
    accumulation: one update per row on the summed gradient, as a torch optimizer);
    :meth:`step` applies the table's optimizer (``TableConfig.optimizer``) to each row
    once, after every table's gradient has been checked (its module's ``nonfinite`` rule),
    then the dense optimizer's step.  Two forwards of one table in a step give one update on
    their summed gradient, as ``nn.EmbeddingBag`` under a torch optimizer would.  A table's
    group starts at the store's learning rate, which a checkpoint keeps: build the optimizer
    after opening the store, then load the scheduler's state.

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig, SGD
    >>> from tiered_emb.torch import TieredEmbeddingBag, TieredOptimizer
    >>> s = TieredStore.create(tempfile.mkdtemp() + "/s", [TableConfig("t", 4, optimizer=SGD(0.1))],
    ...                        TierConfig(hbm_rows=16, device="cpu"))
    >>> model = torch.nn.Sequential(TieredEmbeddingBag(s, "t"), torch.nn.Linear(4, 1))
    >>> opt = TieredOptimizer(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    >>> schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    >>> opt.zero_grad()
    >>> scaler.scale(model(torch.tensor([[1, 2], [3, 3]])).sum()).backward()  # rows not updated yet
    >>> total_norm = opt.clip_grad_norm_(1.0, scaler)   # unscaled first, then clipped together
    >>> scaler.step(opt)                                 # rows and the Linear, or neither
    >>> scaler.update()
    >>> schedule.step()                                  # the next step's rate: 0.05, rows and Linear
    >>> s.engine.table_config("t").optimizer.lr, opt.param_groups[-1]["lr"]
    (0.1, 0.05)
    >>> s.close()
    """

    def __init__(self, model: torch.nn.Module, dense: torch.optim.Optimizer | None = None):
        modules = [m for m in model.modules() if isinstance(m, StoreModule)]
        if not modules:
            raise ConfigError(
                f"model {type(model).__name__} holds no tiered module",
                "pass the model holding TieredEmbeddingBag / TieredEmbedding / TieredEmbeddingBagCollection",
            )
        if dense is not None and not hasattr(dense, "param_groups"):
            raise ConfigError(f"dense={dense!r} is not a torch optimizer", "pass a torch.optim.Optimizer or None")
        self.dense = dense
        self.held = HeldGradients()
        for m in modules:
            m.defer_updates(self.held)
        self.modules = modules
        #: (store, table, group) of each table the modules read, in the order first met
        self._tables: dict[tuple[int, str], tuple[object, str, dict]] = {}
        for m in modules:
            key = (id(m.store), m.table)
            if key not in self._tables:
                lr = m.store.engine.table_config(m.table).optimizer.lr
                self._tables[key] = (m.store, m.table, {"params": [], "lr": lr, "table": m.table})
        self._groups: list[dict] = []
        super().__init__([g for _, _, g in self._tables.values()], {})

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict]:
        """The dense optimizer's groups, then one group per table: its ``"lr"`` and the tensor of
        its held gradient (its ``.grad``: what ``GradScaler.unscale_`` and clipping act on).

        The list and its dicts persist, as a torch optimizer's: a scheduler's changes stay."""
        dense = list(self.dense.param_groups) if self.dense is not None else []
        for key, (_, _, group) in self._tables.items():
            held = self.held.tables.get(key)
            group["params"] = [] if held is None else [held.tensor]
        self._groups[:] = [*dense, *(g for _, _, g in self._tables.values())]
        return self._groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        """Set by ``torch.optim.Optimizer.__init__`` (the table groups; the dense ones are read live)."""
        self._groups = list(groups)

    def add_param_group(self, param_group: dict) -> None:
        """Only the table groups, at construction: add dense groups to the dense optimizer."""
        if any(param_group is g for _, _, g in self._tables.values()):
            self._groups.append(param_group)
            return
        raise ConfigError(
            "TieredOptimizer.add_param_group() of dense parameters",
            "add the group to the dense optimizer it was built with (dense.add_param_group)",
        )

    def parameters(self) -> list[torch.Tensor]:
        """Every tensor of :attr:`param_groups` (for ``torch.nn.utils.clip_grad_norm_`` and the like)."""
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the held gradients (a skipped step's too), and the dense optimizer's."""
        self.held.clear()
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """Apply the held gradients to the rows (the store's optimizer), then the dense step.

        Every table is checked before any row or dense weight changes; a ``nonfinite="raise"``
        module with NaN/inf in its held gradient raises NonFiniteGradientError, changing nothing.
        Each store's step counter then moves on (``store.advance_step()``: expiry runs there).
        Under ``GradScaler.step(opt)`` this runs only for a step without inf/NaN.
        """
        if closure is not None:
            raise ConfigError("step(closure) is not supported", "call backward before step(), without a closure")
        for store, table, group in self._tables.values():  # every rate checked before any is set
            store.engine.table_config(table).with_learning_rate(_rate(group["lr"], table))
        for store, table, group in self._tables.values():
            if float(group["lr"]) != store.engine.table_config(table).optimizer.lr:
                store.set_learning_rate(table, float(group["lr"]))
        updates = self.held.checked_updates()
        for update in updates:
            update()
        for store in {id(s): s for s, _, _ in self._tables.values()}.values():  # once each, in order met
            store.advance_step()
        return self.dense.step() if self.dense is not None else None

    def clip_grad_norm_(self, max_norm: float, scaler=None, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the dense and the held embedding gradients
        together; returns the total norm.  With ``scaler`` (a GradScaler) the gradients are
        unscaled first (``scaler.unscale_(self)``), as torch's recipe for clipping under AMP.

        The embedding gradients are those of the rows touched since :meth:`zero_grad`, summed
        per row: the same norm as the (mostly zero) dense gradient of an ``nn.EmbeddingBag``.
        """
        if scaler is not None:
            scaler.unscale_(self)
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type=norm_type)

    def release(self) -> None:
        """Give the modules back the fused update (held gradients are dropped)."""
        self.held.clear()
        for m in self.modules:
            if m.update_target is self.held:
                m.defer_updates(None)

    def state_dict(self) -> dict:  # type: ignore[override]
        """``{"dense": the dense optimizer's state (or None), "tables": each table group's
        settings but its params ("table", "lr", a scheduler's "initial_lr"...), in order}``.

        The rows' optimizer state lives in the store; the group settings are kept so that a
        resumed run's scheduler goes on from the rates it had, as torch's optimizers keep
        theirs (build the optimizer, then the scheduler, then load both states)."""
        return {
            "dense": self.dense.state_dict() if self.dense is not None else None,
            "tables": [{k: v for k, v in g.items() if k != "params"} for _, _, g in self._tables.values()],
        }

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` returned (or a dense optimizer's state alone, as
        before table groups were kept); ConfigError if its tables are not this optimizer's."""
        if "tables" not in state:  # a dense optimizer's state dict
            if self.dense is not None:
                self.dense.load_state_dict(state)
            return
        groups = [g for _, _, g in self._tables.values()]
        saved = list(state["tables"])
        if [s.get("table") for s in saved] != [g["table"] for g in groups]:
            raise ConfigError(
                f"the state is of tables {[s.get('table') for s in saved]}, this optimizer's are "
                f"{[g['table'] for g in groups]}",
                "load the state of an optimizer built over the same model",
            )
        for g, s in zip(groups, saved, strict=True):
            _rate(s["lr"], g["table"])
        if self.dense is not None and state.get("dense") is not None:
            self.dense.load_state_dict(state["dense"])
        for g, s in zip(groups, saved, strict=True):
            g.update(s)


def _rate(lr, table: str) -> float:
    """A group's ``lr`` as a float (a scheduler may leave a 0-d tensor)."""
    try:
        return float(lr)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"the learning rate of table {table!r} is {lr!r}", "set param_groups[i]['lr'] to a number"
        ) from err
