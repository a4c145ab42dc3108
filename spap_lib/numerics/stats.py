"""Per-channel statistics of the dense model, collected in one pass and shared by score methods.

Score-based baselines (magnitude, Wanda-SP, FLAP, CFSP) look only at the dense model: their masks
need ``‖Z_j‖``, the mean and variance of every intermediate channel ``Z_j``, and (CFSP) how much
each decoder block turns the hidden state. All of it accumulates in O(n) memory per layer, so one
dense pass serves every score method at every sparsity of an ablation grid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spap_lib.numerics.collective import all_sum, all_sum_, total
from spap_lib.numerics.linalg import rows


@dataclass
class ChannelStats:
    """Sums over the N calibration tokens of one layer's MLP intermediate activations ``Z [N, n]``."""

    N: int
    z_sum: torch.Tensor | None  # Σ_t Z_tj                 [n], float64 (None: not measured, ``blocks_only``)
    z_sq: torch.Tensor | None  # Σ_t Z_tj²  (= diag Z Zᵀ)  [n], float64
    angular: float | None = None  # Σ_t arccos(cos(h_in,t, h_out,t))/π of the decoder block (CFSP)
    curve: list[tuple[int, float]] | None = None  # (channels removed, relative error): the "error" allocation

    @property
    def norm(self) -> torch.Tensor:
        """``‖Z_j‖₂`` over all calibration tokens."""
        return self.z_sq.clamp_min(0).sqrt()

    @property
    def mean(self) -> torch.Tensor:
        return self.z_sum / self.N

    @property
    def var(self) -> torch.Tensor:
        """Unbiased variance of each channel over tokens (FLAP's "fluctuation")."""
        return ((self.z_sq - self.N * self.mean.pow(2)) / max(self.N - 1, 1)).clamp_min(0)

    @classmethod
    def norms(cls, z_sq: torch.Tensor, N: int) -> "ChannelStats":
        """Statistics that know ``‖Z_j‖²`` only (a Gram diagonal): the means read as NaN, never as zero."""
        return cls(N, torch.full_like(z_sq, float("nan")), z_sq)

    @classmethod
    def blocks_only(cls, N: int) -> "ChannelStats":
        """No channel statistics, only room for the block's angular distance (an allocation that reads nothing
        else: an allocation whose ``needs`` lack ``channel_stats``); reading a channel's statistics from it fails."""
        return cls(N, None, None)

    @classmethod
    def empty(cls, n: int, device) -> "ChannelStats":
        """Zero sums over no tokens, for ``add`` to fill a chunk at a time."""
        return cls(0, torch.zeros(n, dtype=torch.float64, device=device),
                   torch.zeros(n, dtype=torch.float64, device=device))

    def add(self, Z: torch.Tensor) -> None:
        """Add a chunk of activations ``Z [c, n]`` to the sums. One float64 copy, squared in place: the same sums
        as squaring a second copy, and the caller's ``Z`` is left as it was (a pass that also sums ``Zᵀ Z`` from it,
        ``linalg.gram``'s ``each``)."""
        Z = Z.to(torch.float64, copy=True)
        self.z_sum += Z.sum(0)
        self.z_sq += Z.pow_(2).sum(0)
        self.N += Z.shape[0]

    def summed(self) -> "ChannelStats":
        """The sums over every rank's tokens, in place (``collective``; the identity in one process), once the last
        chunk is added."""
        self.N = total(self.N)
        all_sum_(self.z_sum)
        all_sum_(self.z_sq)
        return self

    @classmethod
    def of(cls, mlp, X: torch.Tensor, chunk: int = 8192) -> "ChannelStats":
        """The sums of an ``MLP``'s (``model.adapters``) intermediate activations over the tokens ``X``, a chunk at a
        time (numerics import nothing above them: the MLP is only called)."""
        stats = cls.empty(mlp.width, mlp.W_out.device)
        with torch.no_grad():
            for start in range(0, X.shape[0], chunk):  # X may wait in host memory (``linalg.rows``)
                stats.add(mlp.hidden(rows(X, start, start + chunk, mlp.W_out.device).float()))
        return stats.summed()


def block_angular(h_in: torch.Tensor, h_out: torch.Tensor, batch: int = 8) -> float:
    """Sum over tokens of the angle between a block's input and output hidden states, in units of π
    (the block-influence metric CFSP allocates sparsity with; ShortGPT's angular distance)."""
    angles = 0.0
    for start in range(0, h_in.shape[0], batch):  # a batch at a time: no float64 copy of all hidden states
        a = h_in[start:start + batch].reshape(-1, h_in.shape[-1]).double()
        b = h_out[start:start + batch].reshape(-1, h_out.shape[-1]).to(a.device).double()
        angles += float(torch.arccos(torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)).sum())
    return all_sum(angles) / math.pi
