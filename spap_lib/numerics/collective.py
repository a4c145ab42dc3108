"""Sums over calibration tokens held by several processes: the one place the numerics meet torch.distributed.

A data-parallel prune (``spap_lib.pipeline.distributed``) gives every rank a contiguous share of the calibration
windows, so a rank's ``X`` holds rows ``start … start + n`` of the one-process ``X``. Every statistic the methods
read is a sum over tokens (Gram matrices, ``Y Zᵀ``, channel sums, errors) and every Adam gradient a sum over a
mini-batch's tokens: each is summed here across ranks, and the token samples are drawn over the global rows, so
every rank computes the same mask and weights as one process would (up to the order of the sums). Outside a
process group every call is the identity: one process runs exactly the code it ran before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spap_lib.errors import SpapError


class RankFailure(SpapError, RuntimeError):
    """Another rank of a data-parallel prune stopped (killed, out of memory, a refusal of its own)."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's rank and the number of ranks (one, outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _call(op, *args, **kw):
    """A collective; a peer that died or left surfaces as one ``RankFailure`` line, not a backend traceback."""
    try:
        return op(*args, **kw)
    except RuntimeError as err:  # gloo's and NCCL's errors (DistBackendError is a RuntimeError)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RankFailure(f"rank {world().rank}: another rank of this run stopped ({first[:160]}); nothing was "
                          "saved. Read the first failing rank's error above; rerun with the same --resume-dir to "
                          "resume after the last finished layer") from None


def all_sum_(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place (float64 sums stay float64); ``t`` itself outside a group."""
    if world().parallel:
        _in_place(dist.all_reduce, t)
    return t


def _in_place(op, t: torch.Tensor, *args) -> None:
    """``op(t, *args)`` on ``t`` where the backend takes it (gloo: host memory, NCCL: this rank's GPU; contiguous),
    through a copy where ``t`` is elsewhere."""
    device = _device()
    if t.device == device and t.is_contiguous():
        _call(op, t.data, *args)
        return
    copy = t.detach().to(device).contiguous()
    _call(op, copy, *args)
    t.data.copy_(copy)


def all_sum(x: float) -> float:
    """A Python number summed over the ranks (in float64)."""
    if not world().parallel:
        return x
    return float(all_sum_(torch.tensor([x], dtype=torch.float64, device=_device()))[0])


def grads_sum_(params: list[torch.Tensor]) -> None:
    """Every parameter's gradient summed over the ranks (a rank that saw no token of a mini-batch adds zeros)."""
    if not world().parallel:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_sum_(p.grad)


def span(n_local: int) -> tuple[int, int]:
    """``(start, total)``: where this rank's ``n_local`` token rows begin in the global rows, and how many there are.
    Ranks hold contiguous shares in rank order (``distributed.share``)."""
    w = world()
    if not w.parallel:
        return 0, n_local
    counts = torch.zeros(w.size, dtype=torch.int64, device=_device())
    counts[w.rank] = n_local
    all_sum_(counts)
    return int(counts[:w.rank].sum()), int(counts.sum())


def total(n_local: int) -> int:
    """The number of token rows over every rank."""
    return span(n_local)[1]


def local_rows(idx: torch.Tensor, start: int, n_local: int) -> torch.Tensor:
    """The global row indices ``idx`` that this rank holds, as indices into its own rows (order kept)."""
    if not world().parallel:
        return idx
    mine = (idx >= start) & (idx < start + n_local)
    return idx[mine] - start


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (a vector), concatenated in rank order: the global vector one process would hold."""
    w = world()
    if not w.parallel:
        return t
    start, n = span(t.shape[0])
    out = torch.zeros(n, dtype=t.dtype, device=_device())
    out[start:start + t.shape[0]] = t.to(out.device)
    return all_sum_(out).to(t.device)


def broadcast_(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values in every rank's ``tensors``, in place: the ranks leave each layer with identical weights
    even where a kernel is not bit-reproducible across devices."""
    if not world().parallel:
        return
    for t in tensors:
        _in_place(dist.broadcast, t, 0)


def barrier() -> None:
    if world().parallel:
        _call(dist.barrier)


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (JSON-like), in rank order; ``[obj]`` outside a group."""
    if not world().parallel:
        return [obj]
    out = [None] * world().size
    _call(dist.all_gather_object, out, obj)
    return out


def _device() -> torch.device:
    """Where the collectives' small tensors live: the host for gloo, this rank's GPU for NCCL."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def subsample(X: torch.Tensor, Y: torch.Tensor | None, tokens: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fixed uniform sample of ``tokens`` of the calibration tokens (in their order), or all of them
    when ``tokens`` is 0 or at least N: the data of the update's intermediate rounds (``Y`` may be None)."""
    start, N = span(X.shape[0])  # across ranks: one sample of the global rows, each rank keeps the ones it holds
    if tokens == 0 or tokens >= N:
        return X, Y
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = local_rows(torch.sort(torch.randperm(N, generator=gen)[:tokens]).values, start, X.shape[0]).to(X.device)
    return X.index_select(0, idx), None if Y is None else Y.index_select(0, idx)
