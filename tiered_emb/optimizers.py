"""Row-wise optimizers: their hyper-parameters and state layouts (data only; the kernels that
apply them are in :mod:`tiered_emb.step.update`).

A row's record is ``[weights (dim) | optimizer state (state_width)]`` in one float32 row,
so the state travels with its row through every tier and into LMDB.  Updates are
*deterministic*: gradients of duplicate ids are summed in batch-position order
(:mod:`tiered_emb.step.reduce`), then each unique row is updated exactly once,
in parallel only across distinct rows; no atomics, no order that depends on threads.

State layouts (after the ``dim`` weights):

=================  ==============  ================================================
optimizer          state_width     contents
=================  ==============  ================================================
``SGD``            0               none
``Adagrad``        dim             element-wise sum of g*g
``RowWiseAdagrad`` 1               one scalar per row: sum over steps of mean(g*g)
``Adam``           2*dim + 1       m (dim), v (dim), the row's own step count
=================  ==============  ================================================

Weight decay, on every optimizer (``weight_decay`` > 0), in FBGEMM's two modes:

- ``weight_decay_mode="l2"``: ``g += weight_decay * w`` before the update (torch's
  ``weight_decay``; for row-wise Adagrad the decayed gradient also feeds the row's mean
  of ``g*g``, as FBGEMM's ``WeightDecayMode.L2``);
- ``"decoupled"``: ``w = (1 - lr * weight_decay) * w`` before the update (AdamW, FBGEMM's
  ``DECOUPLE``).

Decay is applied to the rows a step updates, as FBGEMM's TBE and TorchRec's fused
optimizers do: a row no batch touches keeps its weights (docs/training.md).

``Adam`` is the *lazy* (sparse) variant: a row's moments and step count advance only on
steps where the row receives a gradient, and bias correction uses the row's own count,
as FBGEMM's row-sparse Adam does.  The count is held as float32, exact up to 2**24
(16.7 M) updates of one row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from tiered_emb.errors import ConfigError

_FLOAT32_MAX = 3.4028234663852886e38

#: Weight decay modes, as the kernels take them (``params()[-1]``): none, L2, decoupled.
DECAY_MODES = {"l2": 1.0, "decoupled": 2.0}


def _check_positive(cls: str, field: str, value: float, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(
            f"{cls}.{field}={value!r} is invalid", f"use a finite number {'>= 0' if allow_zero else '> 0'}"
        )


def _check_decay(opt) -> None:
    """The learning rate and the weight decay of ``opt`` checked together."""
    cls = type(opt).__name__
    _check_positive(cls, "lr", opt.lr, allow_zero=True)
    _check_positive(cls, "weight_decay", opt.weight_decay, allow_zero=True)
    if opt.weight_decay_mode not in DECAY_MODES:
        raise ConfigError(
            f"{cls}.weight_decay_mode={opt.weight_decay_mode!r} is invalid", f"use one of {sorted(DECAY_MODES)}"
        )
    if opt.weight_decay_mode == "decoupled" and opt.lr * opt.weight_decay >= 1.0:
        raise ConfigError(
            f"{cls}(lr={opt.lr!r}, weight_decay={opt.weight_decay!r}, weight_decay_mode='decoupled') "
            "would scale rows by 1 - lr * weight_decay <= 0",
            "keep lr * weight_decay below 1 (decoupled decay shrinks a row by that fraction a step)",
        )


def _decay(opt) -> list[float]:
    """The decay's two kernel parameters: ``[weight_decay, mode]`` (mode 0: no decay)."""
    if opt.weight_decay == 0:
        return [0.0, 0.0]
    return [opt.weight_decay, DECAY_MODES[opt.weight_decay_mode]]


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``w -= lr * g``."""

    lr: float = 0.01
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    name = "sgd"

    def __post_init__(self):
        _check_decay(self)

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row of ``dim`` weights: 0 (SGD keeps none)."""
        return 0

    def params(self) -> np.ndarray:
        """The hyper-parameters as the update kernel takes them: float32 (3,), ``[lr, weight_decay, mode]``."""
        return np.array([self.lr, *_decay(self)], dtype=np.float32)


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad: ``s += g*g; w -= lr * g / (sqrt(s) + eps)`` (torch.optim.Adagrad)."""

    lr: float = 0.01
    eps: float = 1e-10
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    name = "adagrad"

    def __post_init__(self):
        _check_decay(self)
        _check_positive("Adagrad", "eps", self.eps, allow_zero=True)

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row of ``dim`` weights: ``dim`` (the sum of g*g per weight)."""
        return dim

    def params(self) -> np.ndarray:
        """The hyper-parameters as the update kernel takes them: float32 (4,), ``[lr, eps, weight_decay, mode]``."""
        return np.array([self.lr, self.eps, *_decay(self)], dtype=np.float32)


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD).

    ``s += mean(g*g)`` over the row; ``w -= lr * g / (sqrt(s) + eps)``.  One scalar of
    state per row instead of ``dim``.
    """

    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    name = "rowwise_adagrad"

    def __post_init__(self):
        _check_decay(self)
        _check_positive("RowWiseAdagrad", "eps", self.eps, allow_zero=True)

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row of ``dim`` weights: 1 (the sum of mean(g*g))."""
        return 1

    def params(self) -> np.ndarray:
        """The hyper-parameters as the update kernel takes them: float32 (4,), ``[lr, eps, weight_decay, mode]``."""
        return np.array([self.lr, self.eps, *_decay(self)], dtype=np.float32)


@dataclass(frozen=True)
class Adam:
    """Lazy (row-sparse) Adam with per-row bias correction; see the module docstring."""

    lr: float = 0.001
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    name = "adam"

    def __post_init__(self):
        _check_decay(self)
        _check_positive("Adam", "eps", self.eps, allow_zero=True)
        b = self.betas
        if not (
            isinstance(b, (tuple, list))
            and len(b) == 2
            and all(isinstance(x, (int, float)) and 0.0 <= x < 1.0 for x in b)
        ):
            raise ConfigError(f"Adam.betas={b!r} is invalid", "give two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))

    def state_width(self, dim: int) -> int:
        """Floats of optimizer state per row of ``dim`` weights: ``2 * dim + 1`` (m, v, the row's step)."""
        return 2 * dim + 1

    def params(self) -> np.ndarray:
        """The hyper-parameters as the update kernel takes them: float32 (6,),
        ``[lr, beta1, beta2, eps, weight_decay, mode]``."""
        return np.array([self.lr, self.betas[0], self.betas[1], self.eps, *_decay(self)], dtype=np.float32)


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam)}


def with_learning_rate(opt, lr, where: str = "set_learning_rate"):
    """``opt`` with learning rate ``lr``: a finite number >= 0 that float32 holds (a schedule may
    reach 0); ConfigError naming ``where`` otherwise."""
    ok = isinstance(lr, numbers.Real) and not isinstance(lr, (bool, np.bool_))
    if not ok or not math.isfinite(lr) or lr < 0 or lr > _FLOAT32_MAX:
        raise ConfigError(
            f"{where}: lr={lr!r} is invalid",
            "give a finite learning rate >= 0 (a schedule that gives a negative or NaN lr is wrong)",
        )
    return dataclasses.replace(opt, lr=float(lr))


def optimizer_from_dict(d: dict):
    """Rebuild an optimizer from :func:`optimizer_to_dict` output (manifest)."""
    d = dict(d)
    name = d.pop("name")
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer name={name!r} is unknown", f"use one of {sorted(OPTIMIZERS)}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return OPTIMIZERS[name](**d)


def optimizer_to_dict(opt) -> dict:
    d = {"name": opt.name}
    d.update({k: getattr(opt, k) for k in opt.__dataclass_fields__})
    if "betas" in d:
        d["betas"] = list(d["betas"])
    return d
