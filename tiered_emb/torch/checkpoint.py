"""A whole model in one call: :func:`save` takes a checkpoint of the store(s) under a model's
tiered modules holding the dense ``state_dict`` (and an optimizer's) in the same
transaction as the rows; :func:`load` restores both into a model built over the reopened
store.

Why not ``torch.save(model)``: the rows are not in the module (they may be far larger
than memory), so the modules refuse to be pickled (:class:`~tiered_emb.errors.CopyError`).
The dense state goes into the checkpoint's ``extra`` bytes, so a crash can never leave
rows of one step beside dense weights of another.
"""

from __future__ import annotations

import io

import torch

from tiered_emb.errors import ConfigError, CorruptStoreError
from tiered_emb.torch._base import stores_of

_FORMAT = "tiered_emb.torch/1"


def _stores(model) -> list:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model of type {type(model).__name__} is invalid", "pass a torch.nn.Module")
    stores = stores_of(model)
    if not stores:
        raise ConfigError(
            f"model {type(model).__name__} holds no tiered module",
            "save a model without tiered modules with torch.save(model.state_dict(), path)",
        )
    return stores


def _not_a_saved_model(store) -> ConfigError:
    return ConfigError(
        f"store {str(store.engine.path)!r} holds checkpoint extra bytes that are not a saved model",
        "load with tiered_emb.torch.load what tiered_emb.torch.save wrote",
    )


def save(model: torch.nn.Module, optimizer=None, extra: dict | None = None) -> int:
    """Checkpoint the rows of ``model``'s stores with its dense state, atomically per store.

    Parameters
    ----------
    model : torch.nn.Module holding Tiered* modules
    optimizer : torch optimizer (or :class:`TieredOptimizer`) whose ``state_dict`` to keep, or None
    extra : dict of plain values (step, epoch...) to keep beside them, or None

    Returns
    -------
    int
        The number of rows written.

    Notes
    -----
    Uses the store's checkpoint ``extra`` bytes (:meth:`TieredStore.checkpoint`); a model
    over several stores checkpoints each with the same state, one after the other.

    Examples
    --------
    >>> import tempfile, torch
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> from tiered_emb.torch import TieredEmbeddingBag, save, load
    >>> path = tempfile.mkdtemp() + "/s"
    >>> s = TieredStore.create(path, [TableConfig("t", 4)], TierConfig(hbm_rows=16, device="cpu"))
    >>> model = torch.nn.Sequential(TieredEmbeddingBag(s, "t"), torch.nn.Linear(4, 1))
    >>> _ = save(model, extra={"step": 7})
    >>> s.close()
    >>> s = TieredStore.open(path)                  # the rows of the checkpoint
    >>> model = torch.nn.Sequential(TieredEmbeddingBag(s, "t"), torch.nn.Linear(4, 1))
    >>> load(model)                                 # the dense weights saved with them
    {'step': 7}
    >>> s.close()
    """
    stores = _stores(model)
    state = {
        "format": _FORMAT,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "extra": dict(extra or {}),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    rows = 0
    for store in stores:
        store.checkpoint(extra=buf.getvalue())
        rows += store.engine.last_checkpoint_rows
    return rows


def load(model: torch.nn.Module, optimizer=None) -> dict:
    """Load the dense state :func:`save` kept in the checkpoint of ``model``'s store into
    ``model`` (and ``optimizer``); returns the ``extra`` dict saved with it.

    Open the store at that checkpoint first (``TieredStore.open(path)``: its rows are
    then the checkpoint's) and build the model over it as before.
    """
    stores = _stores(model)
    saved = [store.extra for store in stores]
    if saved[0] is None:
        raise ConfigError(
            f"store {str(stores[0].engine.path)!r} holds no saved model",
            "save one with tiered_emb.torch.save(model, optimizer)",
        )
    if any(s != saved[0] for s in saved[1:]):
        raise CorruptStoreError(
            f"the stores {[str(s.engine.path) for s in stores]} hold different saved states",
            "a save over several stores was interrupted: open each at a checkpoint of the same save",
        )
    try:
        state = torch.load(io.BytesIO(saved[0]), weights_only=True)
    except Exception as err:  # torch.load raises several kinds for bytes it cannot read
        raise _not_a_saved_model(stores[0]) from err
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise _not_a_saved_model(stores[0])
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ConfigError("the saved model holds no optimizer state", "pass optimizer=None, or save one with it")
        optimizer.load_state_dict(state["optimizer"])
    return state["extra"]
