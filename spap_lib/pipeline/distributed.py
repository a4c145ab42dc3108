"""One prune over K processes (``torchrun --nproc-per-node K -m spap_lib.cli prune …``): data flow only.

Every rank loads the model and draws the same calibration windows, then keeps a contiguous 1/K share of them
(``share``): the host and device memory of a layer's ``X`` and ``Y`` divide by K, and the decoder layer is
replicated. The numerics sum every statistic and gradient over the ranks (``numerics.collective``), so every rank
computes the same mask and weights; the pipeline then takes rank 0's weights at the end of each layer, so the
ranks can never drift apart. Rank 0 alone installs the checkpoint, after every rank has finished.

NCCL on GPUs (one GPU per rank, ``LOCAL_RANK``), gloo on CPUs; multi-node runs are ``torchrun``'s own
(``--nnodes``, ``--rdzv-endpoint``). A rank that dies makes every collective of the others fail
(``collective.RankFailure``), so the run stops with nothing installed.
"""
from __future__ import annotations

import json
import os
import signal
from datetime import timedelta

import torch

from spap_lib.errors import ParameterError
from spap_lib.numerics.collective import RankFailure, World, gather_objects, world

# How long a rank waits for the others at one collective before the run fails: longer than any one step of a
# prune (rank 0 saves the checkpoint while the others wait), short enough that a hung rank is noticed.
TIMEOUT = timedelta(minutes=60)


def launched() -> bool:
    """Whether this process is one rank of several (``torchrun`` sets ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: str) -> tuple[World, str]:
    """Join the process group ``torchrun`` describes (gloo for a CPU run, NCCL for CUDA), once; returns this rank's
    world and its device: ``cuda:LOCAL_RANK`` for a CUDA run, ``device`` as given otherwise."""
    if not launched():
        return world(), device
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device not in ("auto", "cuda"):
            raise ParameterError(f"--device {device} names one GPU, but torchrun gives every rank its own "
                                 "(LOCAL_RANK): give --device cuda or auto")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not torch.distributed.is_initialized():  # CPU threads per rank: OMP_NUM_THREADS (torchrun's default: 1)
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    signal.signal(signal.SIGTERM, _stopped)  # torchrun stops the other ranks when one fails
    return world(), device


def _stopped(signum, frame) -> None:
    raise RankFailure(f"rank {world().rank}: stopped by torchrun because another rank failed (its error and "
                      "torchrun's summary name it); nothing was installed. Rerun with the same --resume-dir to resume "
                      "after the last finished layer")


def share(n: int, w: World | None = None) -> tuple[int, int]:
    """This rank's windows ``[start, stop)`` of ``n``: contiguous, in rank order, sizes differing by at most one."""
    w = w or world()
    base, extra = divmod(n, w.size)
    start = w.rank * base + min(w.rank, extra)
    return start, start + base + (w.rank < extra)


def shares(n: int, size: int) -> list[list[int]]:
    """Every rank's ``[start, stop)`` (the manifest's record of who held which windows)."""
    return [list(share(n, World(r, size))) for r in range(size)]


def one_process(method) -> None:
    """A method that prunes the whole model at once (``pipeline == "model"``) runs in one process."""
    if method.pipeline == "model" and world().parallel:
        raise ParameterError(f"method {method.name!r} prunes the whole model at once, in one process; run it "
                             "without torchrun (data-parallel prunes serve the layer-wise methods)")


def check_size(nsamples: int) -> None:
    """A world larger than the calibration windows leaves a rank with no tokens: refused before any work."""
    w = world()
    if w.size > nsamples:
        raise ParameterError(f"{w.size} ranks for {nsamples} calibration windows: every rank needs at least one; "
                             f"give --nsamples >= {w.size} or run fewer ranks (--nproc-per-node)")


def agree(what: str, fields: dict) -> None:
    """The same ``fields`` (model, data, parameters) on every rank, or a one-line refusal naming the first field
    that differs and each rank's value: ranks pruning different things would sum statistics that mean nothing."""
    if not world().parallel:
        return
    mine = json.loads(json.dumps(fields, sort_keys=True, default=str))
    every = gather_objects(mine)
    for key in sorted(set().union(*every)):
        values = [e.get(key) for e in every]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {json.dumps(v, default=str)[:60]}" for r, v in enumerate(values))
            raise ParameterError(f"the ranks disagree on the {what}'s {key} ({shown}): every rank of one prune must "
                                 "be given the same model, data and parameters")


def record(nsamples: int) -> dict:
    """What the manifest records of a data-parallel run: the world size, the backend and every rank's windows."""
    w = world()
    backend = torch.distributed.get_backend() if w.parallel else None
    return {"world_size": w.size, "backend": backend, "window_shares": shares(nsamples, w.size)}


# Link rates for the all-reduce estimate, GB/s per direction, as the links' specifications give them
# (docs/distributed.md: Where it pays).
LINKS = {"nvlink": ("NVLink", 450.0), "ethernet": ("100 Gb/s Ethernet", 12.5)}


def reduced_bytes(method, shapes: dict, bytes_per: int = 4) -> int:
    """What one layer's prune sums over the ranks, in bytes (``collective``), from ``plan.layer_shapes``: the
    dense Gram matrix (``(n+1)²``), and for an update of rounds each round's kept Gram matrix and ``Y Zᵀ`` and every
    Adam step's gradients of the input projections. Scalars and channel vectors are left out (``O(n)``)."""
    d, n, k = shapes["hidden"], shapes["width"], shapes["kept"]
    rounds = method.am_iters if getattr(method, "rounds_update", False) else 0
    per_round = (k + 1) ** 2 + d * (k + 1) + getattr(method, "adam_steps", 0) * shapes["in_proj"] * k * d
    return bytes_per * ((n + 1) ** 2 + rounds * per_round)


def allreduce_seconds(method, shapes: dict, k: int, link: str) -> float:
    """The whole prune's all-reduce time over ``link`` (a key of ``LINKS``): a ring all-reduce moves
    ``2·(K−1)/K`` times the bytes summed per rank per layer."""
    return 2 * (k - 1) / k * reduced_bytes(method, shapes) / (LINKS[link][1] * 1e9) * shapes["layers"]


def allreduce_lines(method, shapes: dict, k: int) -> list[str]:
    """The plan's lines for ``--world-size``: per layer, the bytes summed and moved per rank, and the whole
    prune's all-reduce time at each of ``LINKS``."""
    summed, layers = reduced_bytes(method, shapes), shapes["layers"]
    times = ", ".join(f"{allreduce_seconds(method, shapes, k, link):.1f} s over {name} ({rate:g} GB/s)"
                      for link, (name, rate) in LINKS.items())
    return [f"all-reduce per layer: {summed / 1e6:.1f} MB summed (float32), {2 * (k - 1) / k * summed / 1e6:.1f} MB "
            f"moved per rank, {layers} layers; whole prune {times}"]
