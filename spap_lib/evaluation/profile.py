"""Inference profile (paper Table 4): time to generate N tokens and peak memory, dense vs pruned.

Decoding one token reads every decoder weight and the LM head once, so removing a share ``r`` of
those bytes bounds the speedup by ``1 / (1 − r)`` (the bytes bound). Timings: CUDA events and peak
allocated memory on a GPU; wall clock and the peak resident set of a fresh process on CPU (each
model is profiled in its own spawned process, so one model's peak does not hide another's; the
peak is reset after loading and warm-up, so it is what generation needs: weights, activations, KV).

Speed depends on shapes only, so a pruned variant is data: the kept channels of every layer
(``Variant``), re-applied to the dense weights inside the profiling process. No checkpoint is written
per variant: for an 8B model they would fill a disk and take most of the notebook's time
(docs/results/zeroshot-profile.md: 05_profile).
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from spap_lib.errors import ParameterError
from spap_lib.model.adapters import get_adapter
from spap_lib.model.formats import FORMATS
from spap_lib.numerics.memory import peak_rss_mb, release_freed, reset_peak_rss


@dataclass(frozen=True)
class Variant:
    """A model to profile: the dense ``source`` (alias, hub id, checkpoint dir or .gguf) and, for a
    pruned variant, the kept dense channels of every layer (``None``: the dense model)."""

    source: str
    kept_channels: list[list[int]] | None = None
    sparsity: float = 0.0  # achieved share of the decoder's parameters removed
    round_to: int | None = None
    # A model reshaped as a whole instead of channel-pruned (a sliced residual stream): the marker of its registered
    # format (``model.formats``) and its plan, which the format's ``shape`` applies to the dense model.
    reshape: tuple[str, dict] | None = None

    @property
    def method(self) -> str | None:
        if self.reshape is not None:
            return FORMATS[self.reshape[0]].method
        return None if self.kept_channels is None else "channels"



def free_device_memory(device: torch.device) -> None:
    gc.collect()
    release_freed()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


DECODE_PATHS = ("eager", "static", "compiled")


def decode_path(device: torch.device, requested: str = "auto") -> tuple[str, str]:
    """The decode path to time on ``device`` and why: ``eager`` (a dynamic KV cache, as ``generate`` by default),
    ``static`` (a preallocated KV cache) or ``compiled`` (the static cache and a ``torch.compile``d decode step)."""
    if requested != "auto":
        if requested not in DECODE_PATHS:
            raise ParameterError(f"decode {requested!r} is not a decode path: use 'auto' or one of {DECODE_PATHS}")
        return requested, "asked for"
    if device.type == "cuda":
        return "compiled", ("CUDA: a static KV cache and a compiled decode step (CUDA graphs), as gpt-fast measures; "
                            "an eager small-batch step times kernel launches, not the model's bytes")
    return "eager", "CPU: the eager path with a dynamic cache (transformers compiles decode steps on accelerators only)"


class _Clock:
    """Marks on the device's own timeline: CUDA events on a GPU (no sync inside the timed loop), else the wall."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@torch.no_grad()
def greedy_tokens(model, prompt: torch.Tensor, new_tokens: int, *, cache=None, step=None,
                  clock: _Clock | None = None) -> torch.Tensor:
    """``new_tokens`` greedy tokens after ``prompt``: one prefill call, then one ``step`` (default the model) per
    token, written into ``cache`` (default a fresh dynamic cache). ``clock`` is marked before the prefill, after
    it and after the last step, so prefill and decode are timed apart."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    step = step or model
    n = prompt.shape[1]
    positions = torch.arange(n + new_tokens, device=prompt.device)
    if clock:
        clock.mark()
    logits = model(input_ids=prompt, past_key_values=cache, cache_position=positions[:n], use_cache=True,
                   logits_to_keep=1).logits
    token = logits[:, -1:].argmax(-1)
    if clock:
        clock.mark()
    out = [token]
    for i in range(n, n + new_tokens - 1):
        # a compiled step with CUDA graphs reuses its output buffer: argmax copies the token out of it
        token = step(input_ids=token, past_key_values=cache, cache_position=positions[i:i + 1], use_cache=True).logits
        token = token[:, -1:].argmax(-1)
        out.append(token)
    if clock:
        clock.mark()
    return torch.cat(out, dim=1)


def _compiled_step(model, device: torch.device):
    """The model's forward compiled whole for one-token steps: CUDA graphs on a GPU ("reduce-overhead"); the
    static cache keeps every step's shapes and addresses fixed, so it compiles once."""
    return torch.compile(model.forward, mode="reduce-overhead" if device.type == "cuda" else "default",
                         fullgraph=True, dynamic=False)


@torch.no_grad()
def time_generation(model, prompt: torch.Tensor, new_tokens: int, repeats: int, warmup: int,
                    decode: str = "auto") -> dict:
    """Greedy generation of exactly ``new_tokens`` tokens, ``repeats`` timed runs after ``warmup`` untimed ones
    (a compiled path warms up at least twice: compile, then record the graph): per run the prefill and the
    decode seconds, the path timed with its reason, and the last run's tokens. A decode step that fails to
    compile is timed on the eager path instead, with a warning naming why."""
    from transformers import StaticCache

    device = prompt.device
    path, reason = decode_path(device, decode)
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + new_tokens) if path != "eager" else None
    step = _compiled_step(model, device) if path == "compiled" else None

    def run(clock=None):
        if cache is not None:
            cache.reset()
        return greedy_tokens(model, prompt, new_tokens, cache=cache, step=step, clock=clock)

    for _ in range(max(warmup, 2 if path == "compiled" else 0)):
        try:
            run()
        except Exception as err:  # noqa: BLE001 -- a failure to compile or to record the graph: time what runs
            if path != "compiled":
                raise
            why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"compiling the decode step failed ({why}); timing the eager path instead", stacklevel=3)
            path, reason, cache, step = "eager", f"compile failed ({why})", None, None
            run()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()  # weights are resident after warm-up; the peak adds activations and KV cache
    prefill, decode_s = [], []
    for _ in range(repeats):
        clock = _Clock(device)
        tokens = run(clock)
        first, rest = clock.spans()
        prefill.append(first)
        decode_s.append(rest)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mb()
    return {"seconds_all": [a + b for a, b in zip(prefill, decode_s)], "prefill_all": prefill, "decode_all": decode_s,
            "peak_mem_mb": peak, "decode": path, "decode_reason": reason, "tokens": tokens[0].tolist()}


@dataclass(frozen=True)
class Timing:
    """What one profile times: a random prompt of ``prompt_len`` tokens, then ``new_tokens`` generated greedily,
    ``repeats`` timed runs after ``warmup`` untimed ones, on ``threads`` (None: torch's default), along the decode
    path ``decode`` (``decode_path``; "auto" picks one per device)."""
    prompt_len: int = 32
    new_tokens: int = 1024
    repeats: int = 3
    warmup: int = 1
    threads: int | None = None
    decode: str = "auto"


def _child(queue, variant: Variant, load_args: dict, timing: Timing):
    try:
        from spap_lib.model.loading import load

        if timing.threads:
            torch.set_num_threads(timing.threads)
        loaded = load(variant.source, **load_args)
        if variant.kept_channels is not None:
            loaded.adapter.keep_channels(variant.kept_channels)
            free_device_memory(loaded.device)  # the dense weights of the removed channels
        elif variant.reshape is not None:
            marker, plan = variant.reshape
            FORMATS[marker].shape(loaded.model, plan)  # the format's shapes, shortcut matrices included
            free_device_memory(loaded.device)
        gen = torch.Generator().manual_seed(0)
        vocab = loaded.model.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(0, vocab, (1, timing.prompt_len), generator=gen).to(loaded.device)
        result = time_generation(loaded.model, prompt, timing.new_tokens, timing.repeats, timing.warmup, timing.decode)
        read = weights_read_per_token(loaded.model)
        queue.put({**result, "weights_read": read, "bytes_read": read * loaded.model.dtype.itemsize,
                   "device": str(loaded.device), "threads": torch.get_num_threads()})
    except Exception as err:  # report to the parent instead of dying silently
        queue.put({"error": f"{type(err).__name__}: {err}"})


def profile(model: str | Variant, *, device: str = "auto", dtype: str = "auto", **timing) -> dict:
    """Profile one model (alias, checkpoint dir or ``Variant``) in a fresh process; returns timings and memory.
    ``timing``: ``Timing``'s fields (prompt length, tokens, repeats, warm-up, threads, decode path)."""
    variant = model if isinstance(model, Variant) else Variant(model)
    timing = Timing(**timing)
    decode_path(torch.device("cpu"), timing.decode)  # an unknown path fails here, before a process is spawned
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, variant, {"device": device, "dtype": dtype}, timing))
    proc.start()
    result = queue.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"profiling {variant.source} failed: {result['error']}")
    return result


_POOLED = ("seconds_all", "prefill_all", "decode_all")  # per-run timings, pooled over rounds


def profile_rounds(sources: dict[str, str | Variant], *, rounds: int = 1, **kwargs) -> dict[str, dict]:
    """Profile every model ``rounds`` times, alternating the order each round (A B C, C B A, ...), and pool
    the timed runs per model. Slow drift of the machine (other tenants, thermal state) then lands on every
    model alike instead of on whichever ran last; a fresh process per model and round keeps peaks apart.
    """
    if rounds < 1:
        raise ParameterError(f"rounds must be >= 1, got {rounds}")
    pooled: dict[str, dict] = {}
    for k in range(rounds):
        for label in (list(sources) if k % 2 == 0 else list(sources)[::-1]):
            res = profile(sources[label], **kwargs)
            if label in pooled:
                for key in _POOLED:
                    pooled[label][key] += res[key]
                pooled[label]["peak_mem_mb"] = max(pooled[label]["peak_mem_mb"], res["peak_mem_mb"])
            else:
                pooled[label] = res
    for res in pooled.values():
        times = res["seconds_all"]
        res.update(seconds_median=statistics.median(times), seconds_min=min(times), seconds_max=max(times),
                   runs=len(times))
    return {label: pooled[label] for label in sources}


def summary_table(model: str, variant_method: str, variants: dict[str, Variant], results: dict[str, dict],
                  new_tokens: int):
    """One row per model (dense first): the decode path timed, whole-generation seconds, prefill and per-token
    decode times (medians), tokens per second, the achieved weight bandwidth (weight bytes read per token ×
    tokens per second), peak memory; the decode ``speedup`` over dense, the ``bytes_bound`` and ``of_bound`` =
    (speedup − 1) / (bytes bound − 1), the share of the theoretical gain realised."""
    import pandas as pd

    rows = []
    for label, v in variants.items():
        res = results[label]
        kind = v.method
        # per decoded token (the first token comes from the prefill): none to time when only one is generated
        decode_ms = statistics.median(res["decode_all"]) / (new_tokens - 1) * 1e3 if new_tokens > 1 else float("nan")
        rows.append({"model": model, "method": {None: "dense", "channels": variant_method}.get(kind, kind),
                     "variant": label, "sparsity": v.sparsity, "round_to": v.round_to or 0, "device": res["device"],
                     "threads": res["threads"], "decode": res["decode"], "new_tokens": new_tokens,
                     "seconds_median": res["seconds_median"], "seconds_min": res["seconds_min"],
                     "seconds_max": res["seconds_max"], "runs": res["runs"],
                     "prefill_ms": statistics.median(res["prefill_all"]) * 1e3, "decode_ms_per_token": decode_ms,
                     "tokens_per_s": 1e3 / decode_ms, "bandwidth_gb_s": res["bytes_read"] / decode_ms / 1e6,
                     "peak_mem_mb": res["peak_mem_mb"], "weights_read": res["weights_read"],
                     "decode_reason": res["decode_reason"]})
    table = pd.DataFrame(rows)
    dense = table.iloc[0]
    table["speedup"] = dense["decode_ms_per_token"] / table["decode_ms_per_token"]
    table["bytes_bound"] = [bytes_bound(dense["weights_read"], read) for read in table["weights_read"]]
    table["of_bound"] = (table["speedup"] - 1) / (table["bytes_bound"] - 1).where(table["bytes_bound"] > 1)
    return table
