"""Perplexity on WikiText-2 raw test: the protocol of SparseGPT, Wanda, FLAP, SliceGPT and SPAP.

Rows joined with "\\n\\n", tokenized once, cut into non-overlapping windows of ``seqlen`` tokens
(the remainder is dropped), ppl = exp(mean next-token NLL over all windows).
"""
from __future__ import annotations

import math

import torch
from tqdm import tqdm

from spap_lib.checks import Spec, fits_context
from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import tokenize, wikitext
from spap_lib.model.capture import streamed_logits
from spap_lib.model.loading import context_length
from spap_lib.model.offload import first_device
from spap_lib.numerics.collective import all_sum_, world
from spap_lib.numerics.linalg import NumericalError

LOSS_CHUNK = 256  # positions per cross-entropy call


@torch.no_grad()
def perplexity_of_ids(model, ids: torch.Tensor, seqlen: int, max_windows: int | None = None,
                      device=None, progress: bool = True, onloader=None) -> dict:
    """``onloader`` with offloaded weights (``Loaded.onloader``): evaluate layer by layer over all
    windows, within the memory of one decoder layer (``capture.streamed_logits``)."""
    Spec(int, ge=2).check("eval_seqlen", seqlen)
    Spec(int, ge=1, optional=True).check("eval_windows", max_windows)  # None = the whole test split
    fits_context("eval_seqlen", seqlen, context_length(model.config))
    n = ids.numel() // seqlen
    if n == 0:
        raise ParameterError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    if max_windows is not None:
        n = min(n, int(max_windows))
    # Position spans: a float32 copy and log-softmax of a whole window's logits would double them at the evaluation's
    # peak (docs/scale.md: Memory per layer); streamed, only one span's logits exist at all.
    spans = [(s, min(s + LOSS_CHUNK, seqlen - 1)) for s in range(0, seqlen - 1, LOSS_CHUNK)]
    sums = [0.0] * n
    w = world()
    mine = list(range(w.rank, n, w.size))  # a data-parallel run's ranks share the windows; one process: all

    def add(i: int, s: int, logits: torch.Tensor) -> None:
        """Window ``i``'s summed next-token loss over positions ``s, …`` (``logits [1, positions, V]``)."""
        start = i * seqlen + s + 1
        x = ids[start:start + logits.shape[1]].to(logits.device)
        sums[i] += float(torch.nn.functional.cross_entropy(logits[0].float(), x, reduction="sum"))
        if s + logits.shape[1] == seqlen - 1 and not math.isfinite(sums[i]):  # the window's last span
            raise NumericalError(f"window {i} of ppl@{seqlen}: the loss is {sums[i] / (seqlen - 1)} (NaN/Inf logits): "
                                 "the model is numerically broken; its perplexity would be meaningless")

    if onloader is not None and onloader.streams:
        windows = ids[:n * seqlen].reshape(n, seqlen)[mine]
        streamed_logits(model, onloader, windows, lambda k, s, logits: add(mine[k], s, logits), spans=spans)
    else:
        device = device or first_device(model)
        for i in tqdm(mine, desc=f"ppl@{seqlen}", disable=not progress or w.rank > 0):
            logits = model(input_ids=ids[i * seqlen:(i + 1) * seqlen].unsqueeze(0).to(device), use_cache=False).logits
            for s, e in spans:
                add(i, s, logits[:, s:e])
    if w.parallel:
        sums = all_sum_(torch.tensor(sums, dtype=torch.float64)).tolist()
    losses = [total / (seqlen - 1) for total in sums]
    return {"ppl": math.exp(sum(losses) / n), "seqlen": seqlen, "windows": n,
            "all_windows": n == ids.numel() // seqlen}


def perplexity(model, tokenizer, seqlen: int = 2048, max_windows: int | None = None, progress: bool = True,
               onloader=None) -> dict:
    """WikiText-2 test perplexity; the returned dict says how many windows were used."""
    text = wikitext("test")
    result = perplexity_of_ids(model, tokenize(tokenizer, text.text), seqlen, max_windows, progress=progress,
                               onloader=onloader)
    return {**result, "source": text.source}
