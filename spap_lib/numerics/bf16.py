"""bf16 products on a CPU without bf16 units: the same numbers at the float32 rate.

``linalg.products`` gives approximate products (bf16 inputs, float32 sums, bf16 outputs: ``torch.autocast``'s)
where they are later corrected. On a CPU that multiplies bf16 in hardware (AVX512-BF16, AMX) autocast's kernels run
faster than the float32 ones; on an AVX512 CPU without them they convert every operand on the fly, slower than the
float32 products they replace (docs/method/update-cost.md: bf16 products on a CPU without bf16 units).
There the same products are computed by the float32 kernels on operands rounded to bf16, the result rounded to bf16:
a product of two bf16 values is exact in float32, and both kernels sum in float32, so the two differ only in the
order of the sums, as two CPUs' bf16 kernels do.

Which kernels run is a property of the machine, not of the method: ``SPAP_BF16_PRODUCTS`` = ``auto`` (the default:
``rounded`` on an x86 CPU without AVX512-BF16 or AMX, ``native`` elsewhere), ``native`` or ``rounded``; a run's
manifest records the choice (``kernels``).
"""
from __future__ import annotations

import os
import platform
from contextlib import contextmanager
from functools import cache

import torch
from torch.overrides import TorchFunctionMode

from spap_lib.errors import ParameterError

BF16 = torch.bfloat16
CHOICES = ("auto", "native", "rounded")
_F = torch.nn.functional


def policy() -> str:
    """``SPAP_BF16_PRODUCTS``, checked: read at every use, so that a benchmark can compare both in one run."""
    value = os.environ.get("SPAP_BF16_PRODUCTS", "auto")
    if value not in CHOICES:
        raise ParameterError(f"SPAP_BF16_PRODUCTS={value!r}: choose one of {', '.join(CHOICES)} (or unset it: auto)")
    return value


@cache  # the hardware's: asked at every bf16 product block
def has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 or AMX on x86; assumed on other architectures,
    where autocast's kernels are kept (not measured there)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: True)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def rounded(device) -> bool:
    """Whether bf16 products on ``device`` take the float32 kernels on rounded operands (CPU only)."""
    if torch.device(device).type != "cpu":
        return False
    choice = policy()
    return choice == "rounded" or (choice == "auto" and not has_bf16_units())


def kernels(device) -> str:
    """For a manifest: ``"native"`` (autocast's bf16 kernels) or ``"rounded"`` (float32 kernels, rounded operands)."""
    return "rounded" if rounded(device) else "native"


class _Linear(torch.autograd.Function):
    """``F.linear`` as autocast runs it in bf16: operands and result rounded to bf16, the backward's products too
    (the incoming gradient is a bf16 tensor, each input's gradient rounded to bf16 before it takes its dtype)."""

    @staticmethod
    def forward(ctx, x, W, b):
        xr, Wr = x.to(BF16), W.to(BF16)
        ctx.save_for_backward(xr, Wr)
        ctx.dtypes = (x.dtype, W.dtype, None if b is None else b.dtype)
        with torch.autocast("cpu", enabled=False):
            out = _F.linear(xr.float(), Wr.float(), None if b is None else b.to(BF16).float())
        return out.to(BF16)

    @staticmethod
    def backward(ctx, g):
        xr, Wr = ctx.saved_tensors
        x_dtype, W_dtype, b_dtype = ctx.dtypes
        g = g.float()
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g @ Wr.float()).to(BF16).to(x_dtype) if ctx.needs_input_grad[0] else None
        dW = (g2.T @ xr.float().reshape(-1, xr.shape[-1])).to(BF16).to(W_dtype) if ctx.needs_input_grad[1] else None
        db = g2.sum(0).to(BF16).to(b_dtype) if ctx.needs_input_grad[2] else None
        return dx, dW, db


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _cast(*tensors) -> bool:
    """Whether autocast would run these operands in bf16: float32 and half types are cast, float64 is not."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16, BF16))
               for t in tensors)


class _RoundedProducts(TorchFunctionMode):
    """Inside autocast (and only where it is enabled: code that turns it off, e.g. transformers' rotary
    frequencies, keeps its float32 products), every linear layer, and every matrix product needing no gradient,
    is computed as ``_Linear`` computes it. Other autocast operations (attention kernels) keep autocast's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        if func is _F.linear:  # linear(input, weight, bias=None)
            x = args[0] if args else kwargs["input"]
            W = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if _cast(x, W, b):
                return _Linear.apply(x, W, b)
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) == 2 and not kwargs \
                and _cast(*args) and not _needs_grad(*args):
            a, b = args[0], args[1]
            with torch.autocast("cpu", enabled=False):
                return torch.matmul(a.to(BF16).float(), b.to(BF16).float()).to(BF16)
        return func(*args, **kwargs)


@contextmanager
def autocast(device):
    """bf16 products on ``device`` for the duration of the block: autocast, with the rounded float32 kernels
    where ``rounded(device)``."""
    device = torch.device(device)
    with torch.autocast(device_type=device.type, dtype=BF16):
        if not rounded(device):
            yield
            return
        with _RoundedProducts():
            yield
