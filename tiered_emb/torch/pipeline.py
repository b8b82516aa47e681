"""The training loop with lookahead: :class:`TrainPipeline`."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tiered_emb.errors import ConfigError
from tiered_emb.prefetch import lookahead
from tiered_emb.torch.optim import TieredOptimizer


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
    optimizer : torch.optim.Optimizer for the dense parameters (or None), or a
        :class:`TieredOptimizer` (the rows then update at its step)
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
        the background thread a core of its own: on 2 cores, 1 made the DLRM job faster
        (docs/benchmarks.md).  Not the default because torch's dense kernels may sum in
        another order on another thread count, so the dense model (and, through its
        gradients, the rows) would differ from a run without the pipeline; the store's own
        results never depend on it.
    scaler : torch.amp.GradScaler or None: each step runs ``scaler.scale(loss).backward()``,
        ``scaler.step(optimizer)`` and ``scaler.update()``; needs a :class:`TieredOptimizer`
        (ConfigError otherwise: the fused update would apply the scaled gradient)

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
        scaler=None,
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
        if scaler is not None and not isinstance(optimizer, TieredOptimizer):
            raise ConfigError(
                f"scaler with an optimizer of type {type(optimizer).__name__}",
                "pass optimizer=TieredOptimizer(model, dense_optimizer): the rows must get the unscaled "
                "gradient, and skip the steps the scaler skips",
            )
        self.scaler = scaler
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
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                    yield float(loss.detach())
                    continue
                loss.backward()
                if self.optimizer is not None:
                    self.optimizer.step()
                if not isinstance(self.optimizer, TieredOptimizer):  # (its step() moves the counter)
                    self.store.advance_step()
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
