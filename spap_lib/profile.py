"""Inference profile (paper Table 4): time to generate N tokens and peak memory, dense vs pruned.

Decoding one token reads every decoder weight and the LM head once, so removing a share ``r`` of
those bytes bounds the speedup by ``1 / (1 − r)`` (the bytes bound). Timings: CUDA events and peak
allocated memory on a GPU; wall clock and the peak resident set of a fresh process on CPU (each
model is profiled in its own spawned process, so one model's peak does not hide another's; the
peak is reset after loading and warm-up, so it is what generation needs: weights, activations, KV).
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from .adapters import get_adapter
from .memory import peak_rss_mb, reset_peak_rss


def weights_read_per_token(model) -> int:
    """Parameters a decoding step reads: the decoder layers, the final norm and the LM head
    (the embedding lookup reads one row, so a tied embedding counts once, as the head)."""
    adapter = get_adapter(model)
    decoder = adapter.decoder_params()
    head = model.get_output_embeddings().weight.numel()
    norm = sum(p.numel() for n, p in model.named_parameters() if "norm" in n and ".layers." not in n)
    return decoder + head + norm


def bytes_bound(dense_read: int, pruned_read: int) -> float:
    return dense_read / pruned_read


@torch.no_grad()
def time_generation(model, prompt: torch.Tensor, new_tokens: int, repeats: int, warmup: int) -> dict:
    """Greedy generation of exactly ``new_tokens`` tokens; median and spread over ``repeats`` runs."""
    device = prompt.device
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=0)
    for _ in range(warmup):
        model.generate(prompt, **kwargs)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.generate(prompt, **kwargs)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        reset_peak_rss()  # weights are resident after warm-up; the peak adds activations and KV cache
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(prompt, **kwargs)
            times.append(time.perf_counter() - t0)
        peak = peak_rss_mb()
    return {"seconds_median": statistics.median(times), "seconds_min": min(times), "seconds_max": max(times),
            "seconds_all": times, "peak_mem_mb": peak}


def _child(queue, load_args: dict, prompt_len: int, new_tokens: int, repeats: int, warmup: int, threads: int | None):
    try:
        from .models import load

        if threads:
            torch.set_num_threads(threads)
        loaded = load(**load_args)
        gen = torch.Generator().manual_seed(0)
        vocab = loaded.model.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen).to(loaded.device)
        result = time_generation(loaded.model, prompt, new_tokens, repeats, warmup)
        queue.put({**result, "weights_read": weights_read_per_token(loaded.model),
                   "device": str(loaded.device), "threads": torch.get_num_threads()})
    except Exception as err:  # report to the parent instead of dying silently
        queue.put({"error": f"{type(err).__name__}: {err}"})


def profile(model: str, *, device: str = "auto", dtype: str = "auto", prompt_len: int = 32, new_tokens: int = 1024,
            repeats: int = 3, warmup: int = 1, threads: int | None = None) -> dict:
    """Profile one model (alias or checkpoint dir) in a fresh process; returns timings and memory."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, {"name": model, "device": device, "dtype": dtype}, prompt_len,
                                            new_tokens, repeats, warmup, threads))
    proc.start()
    result = queue.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"profiling {model} failed: {result['error']}")
    return result


def profile_rounds(sources: dict[str, str], *, rounds: int = 1, **kwargs) -> dict[str, dict]:
    """Profile every model ``rounds`` times, alternating the order each round (A B C, C B A, ...), and pool
    the timed runs per model. Slow drift of the machine (other tenants, thermal state) then lands on every
    model alike instead of on whichever ran last; a fresh process per model and round keeps peaks apart.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    pooled: dict[str, dict] = {}
    for k in range(rounds):
        for label in (list(sources) if k % 2 == 0 else list(sources)[::-1]):
            res = profile(sources[label], **kwargs)
            if label in pooled:
                pooled[label]["seconds_all"] += res["seconds_all"]
                pooled[label]["peak_mem_mb"] = max(pooled[label]["peak_mem_mb"], res["peak_mem_mb"])
            else:
                pooled[label] = res
    for res in pooled.values():
        times = res["seconds_all"]
        res.update(seconds_median=statistics.median(times), seconds_min=min(times), seconds_max=max(times),
                   runs=len(times))
    return {label: pooled[label] for label in sources}
