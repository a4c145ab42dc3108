"""Peak memory of a stage of this process: host resident set (Linux VmHWM, reset per stage) and CUDA.

Used by the inference profile and recorded by every prune (the manifest's ``memory``), so the plan's
predictions can be checked against what a run really used.
"""
from __future__ import annotations

import ctypes
import gc
import resource
import sys
from contextlib import contextmanager

import torch

_before_resets = 0.0  # the highest high-water mark a reset cleared (``process_peak_rss_mb``)


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (Linux), so the peak covers one stage only; the
    mark it clears is kept for ``process_peak_rss_mb``."""
    global _before_resets
    _before_resets = max(_before_resets, peak_rss_mb())
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set of this process: VmHWM on Linux (per address space, so a spawned child does
    not inherit its parent's peak the way ``ru_maxrss`` does across exec), ru_maxrss elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def process_peak_rss_mb() -> float:
    """Peak resident set of the whole process so far, across the per-stage resets of ``measured``."""
    return max(_before_resets, peak_rss_mb())


def rss_mb() -> float:
    """Current resident set of this process (VmRSS; the peak where that is not available)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    return peak_rss_mb()


def release_freed() -> None:
    """Give memory freed by Python back to the OS (glibc keeps freed heap pages otherwise, so a process
    streaming layer after layer would grow to its largest-ever footprint and stay there)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@contextmanager
def measured(device: torch.device | str = "cpu"):
    """Yield a dict that holds, after the block: resident set before it, its peak during it (Linux:
    the high-water mark is reset at the start), and the CUDA peak allocated on ``device``.

    Memory freed before the block is handed back first: the allocator would otherwise serve part of
    the block from pages the process already holds, and the peak's increase would understate the
    block's working memory by as much."""
    device = torch.device(device)
    gc.collect()
    release_freed()
    out = {"rss_before_mb": rss_mb(), "peak_reset": reset_peak_rss()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield out
    finally:
        out["peak_rss_mb"] = peak_rss_mb()
        if device.type == "cuda":
            out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
