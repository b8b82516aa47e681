"""Arrays between ranks: one all-to-all of NumPy arrays per call, over torch.distributed.

Each rank gives a list of arrays for every rank; each gets, from every rank, the list
addressed to it.  Two collectives a call: the byte counts (``all_to_all_single`` of int64),
then the bytes themselves, each rank's arrays packed one after the other behind a header
naming their dtypes and shapes.  gloo carries it on CPU, NCCL on a GPU (the buffers go to
the group's device).  Nothing else moves data between ranks; the bytes a rank sends to
the others are counted (:attr:`Exchange.sent`).

Floats can travel in 16 bits (:func:`encode`): float16 or bfloat16, rounded to nearest
even, and widened again on arrival.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from tiered_emb.errors import ConfigError, DistributedError

#: dtypes an array may travel as, by code (bfloat16 travels as its uint16 bits)
_DTYPES = (np.int64, np.float32, np.float16, np.uint16, np.int32, np.uint8, np.float64)
_CODE = {np.dtype(d): i for i, d in enumerate(_DTYPES)}
_ALIGN = 8

#: ``comm_dtype`` names: the float type rows and gradients cross ranks in
COMM_DTYPES = ("fp32", "fp16", "bf16")


def encode(a: np.ndarray, comm_dtype: str) -> np.ndarray:
    """``a`` (float32) as it crosses ranks: itself, float16, or bfloat16 bits (uint16),
    each rounded to nearest even."""
    if comm_dtype == "fp32":
        return np.ascontiguousarray(a, dtype=np.float32)
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # (torch converts on every core; NumPy on one)
    if comm_dtype == "fp16":
        return t.to(torch.float16).numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def decode(a: np.ndarray) -> np.ndarray:
    """A float array received: float32 again (bfloat16 bits widened exactly)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if a.dtype == np.float16:
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float32).numpy()
    return np.ascontiguousarray(a, dtype=np.float32)


def check_comm_dtype(comm_dtype: str) -> str:
    if comm_dtype not in COMM_DTYPES:
        raise ConfigError(f"comm_dtype={comm_dtype!r}", f"use one of {list(COMM_DTYPES)}")
    return comm_dtype


def _pack(arrays: list[np.ndarray]) -> np.ndarray:
    header = [len(arrays)]
    for a in arrays:
        if a.dtype not in _CODE:
            raise TypeError(f"an array of {a.dtype} cannot cross ranks")
        header += [_CODE[a.dtype], a.ndim, *a.shape]
    parts = [np.asarray(header, dtype=np.int64).view(np.uint8)]
    for a in arrays:
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        parts.append(raw)
        pad = -raw.shape[0] % _ALIGN
        if pad:
            parts.append(np.zeros(pad, dtype=np.uint8))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _unpack(buf: np.ndarray) -> list[np.ndarray]:
    words = buf.view(np.int64)
    n, at = int(words[0]), 1
    specs = []
    for _ in range(n):
        code, ndim = int(words[at]), int(words[at + 1])
        specs.append((_DTYPES[code], tuple(int(x) for x in words[at + 2 : at + 2 + ndim])))
        at += 2 + ndim
    pos = at * 8
    out = []
    for dt, shape in specs:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        out.append(buf[pos : pos + size].view(dt).reshape(shape))
        pos += size + (-size % _ALIGN)
    return out


class Exchange:
    """All-to-all of array lists within ``group`` (None: the default group)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(
                "torch.distributed is not initialised",
                "call torch.distributed.init_process_group (gloo on CPU, nccl on a GPU) first, or run under torchrun",
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.sent = 0  # bytes this rank sent to other ranks, every call together

    def all_to_all(self, outgoing: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """``outgoing[r]``: the arrays for rank r.  Returns ``incoming[r]``: rank r's arrays for this one."""
        packed = [_pack(arrays) for arrays in outgoing]
        sizes = [p.shape[0] for p in packed]
        self.sent += sum(s for r, s in enumerate(sizes) if r != self.rank)
        send_counts = torch.tensor(sizes, dtype=torch.int64, device=self.device)
        recv_counts = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        with self._collective("an all-to-all"):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_sizes = recv_counts.cpu().tolist()
        send = torch.from_numpy(np.concatenate(packed)).to(self.device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        with self._collective("an all-to-all"):
            dist.all_to_all_single(recv, send, recv_sizes, sizes, group=self.group)
        flat = recv.cpu().numpy()
        bounds = np.concatenate([[0], np.cumsum(recv_sizes)])
        return [_unpack(flat[bounds[r] : bounds[r + 1]]) for r in range(self.world_size)]

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A collective whose failure (a rank that died, or did not come within the group's
        timeout) is a :class:`DistributedError` naming this rank and what it was doing."""
        try:
            yield
        except (RuntimeError, OSError) as e:
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete ({type(e).__name__}: {e})",
                "another rank died or hung: read its log; the group's timeout (init_process_group(timeout=...)) "
                "bounds the wait",
            ) from e

    def agree(self, failure: BaseException | None, what: str) -> None:
        """Every rank says whether its part of ``what`` succeeded; raise on every rank if one
        did not (``failure`` itself on the rank that met it, :class:`DistributedError` naming
        the first failed rank on the others), so that no rank goes on into a collective the
        failed one will not join, and no rank changes a row another refused."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        flags[self.rank] = 0 if failure is None else 1
        with self._collective(what):
            dist.all_reduce(flags, group=self.group)
        if failure is not None:
            raise failure
        bad = [r for r, f in enumerate(flags.cpu().tolist()) if f]
        if bad:
            raise DistributedError(
                f"{what} failed on rank {bad[0]} (ranks {bad}); nothing was changed on any rank",
                "read that rank's error: it names the cause (an id out of range, a NaN gradient...)",
            )

    def gather_strings(self, value: str, what: str) -> list[str]:
        """Every rank's ``value`` (at most 64 bytes of UTF-8), in rank order."""
        raw = value.encode("utf-8")
        if len(raw) > 64:
            raise ValueError(f"{what}: {len(raw)} bytes, over 64")
        mine = torch.from_numpy(np.frombuffer(raw.ljust(64, b"\0"), dtype=np.uint8).copy()).to(self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self._collective(what):
            dist.all_gather(every, mine, group=self.group)
        return [bytes(t.cpu().numpy()).rstrip(b"\0").decode("utf-8") for t in every]

    def same_on_every_rank(self, value: str, what: str, ignore: str | None = None) -> None:
        """Raise :class:`DistributedError` unless ``value`` (a short string) is equal on every
        rank (ranks giving ``ignore`` aside)."""
        seen = self.gather_strings(value, what)
        given = [v for v in seen if v != ignore]
        if given and any(v != given[0] for v in given):
            differ = [r for r, v in enumerate(seen) if v != ignore and v != given[0]]
            raise DistributedError(
                f"{what} differs between ranks: rank {self.rank} has {value[:16]}..., ranks {differ} another",
                "start every rank with the same plan, tables, seed and store root",
            )


__all__ = ["COMM_DTYPES", "Exchange", "check_comm_dtype", "decode", "encode"]
