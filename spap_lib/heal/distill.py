"""Knowledge distillation of a pruned model from its dense source: the KL divergence of the two models' logits,
averaged over tokens (optionally with the last hidden states' normalised squared error), minimised by AdamW.

What learns is ``HealConfig.train``: every weight, the MLPs only, or LoRA adapters on every linear layer of the
decoder (``peft``), merged back into the weights at the end, so that the checkpoint stays a stock checkpoint of its
architecture. The teacher runs beside the student, one batch at a time, without gradients. Under a data-parallel
run every rank takes its share of each batch's windows and the gradients are summed over the ranks, as the
prune's update's are, so every rank takes the same step.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from spap_lib.heal import state as saved
from spap_lib.heal.data import HealWindows
from spap_lib.model.loading import Loaded
from spap_lib.numerics import bf16
from spap_lib.numerics.collective import all_sum, grads_sum_, world
from spap_lib.pipeline.distributed import share
from spap_lib.settings import HealConfig

CLIP = 1.0  # gradient norm: a short heal at a high learning rate must not be thrown off by one batch
CHUNK = 1024  # tokens per slice of the KL term's float32 log-probabilities on a GPU
ROWS = 32  # on a CPU: a slice of this many rows of the vocabulary stays in the cache through its passes
SAVE_SECONDS = 120.0  # the resume point is written at most this often (and after the last step)


def precision(device: torch.device, choice: str) -> str:
    """``bf16`` where the device multiplies bf16 fast (a GPU that has it, a CPU with AVX512-BF16 or AMX)."""
    if choice != "auto":
        return choice
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "float32"
    return "bf16" if device.type == "cpu" and bf16.has_bf16_units() else "float32"


def learners(loaded: Loaded, cfg: HealConfig) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """The module to call and its learning parameters by name; every other weight is frozen."""
    model = loaded.model
    model.requires_grad_(False)
    if cfg.train == "lora":
        from peft import LoraConfig, get_peft_model

        inside = {id(m) for m in loaded.adapter.layers().modules()}  # the decoder's linear layers, not the head
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside]
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank, lora_dropout=0.0,
                                                 target_modules=names))
    elif cfg.train == "mlp":
        for layer in loaded.adapter.layers():
            loaded.adapter.mlp_owner(layer).requires_grad_(True)
    else:
        model.requires_grad_(True)
    return model, {n: p for n, p in model.named_parameters() if p.requires_grad}


class _KL(torch.autograd.Function):
    """Σ over rows of KL(softmax(t/T) ‖ softmax(s/T)) × T², with its gradient ``T·(softmax(s/T) − softmax(t/T))``
    written out in the forward, a slice of rows at a time: one tensor of the logits' size kept for the backward, in
    their dtype, where autograd would keep the float32 log-probabilities of both and replay their chain. On a CPU a
    slice is a few rows (``ROWS``), so that its float32 temporaries stay in the cache (and are reused by the
    allocator) across the several passes it takes; on a GPU, ``CHUNK`` rows, few enough kernel launches."""

    @staticmethod
    def forward(ctx, student, teacher, temperature):
        s, t = student.flatten(0, -2), teacher.flatten(0, -2)
        grad = torch.empty_like(s)
        total = torch.zeros((), dtype=torch.float32, device=s.device)
        rows = ROWS if s.device.type == "cpu" else CHUNK
        for i in range(0, s.shape[0], rows):
            ls, lt = s[i:i + rows].float(), t[i:i + rows].float()
            if temperature != 1:
                ls, lt = ls.div_(temperature), lt.div_(temperature)
            ls, lt = F.log_softmax(ls, -1), F.log_softmax(lt, -1)
            pt = lt.exp()
            total += lt.sub_(ls).mul_(pt).sum()  # Σ p_t (log p_t − log p_s)
            grad[i:i + rows] = ls.exp_().sub_(pt).mul_(temperature)
        ctx.save_for_backward(grad)
        ctx.shape = student.shape
        return total * temperature ** 2

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return (grad * g.to(grad.dtype)).view(ctx.shape), None, None


def kl_sum(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Σ over tokens of KL(teacher ‖ student) of the softened distributions, × T² (Hinton et al.), in float32."""
    return _KL.apply(student, teacher.detach(), temperature)


def _loss(model, teacher, ids: torch.Tensor, cfg: HealConfig) -> torch.Tensor:
    hidden = cfg.hidden_weight > 0
    with torch.no_grad():
        t = teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden)
    s = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
    loss = kl_sum(s.logits, t.logits, cfg.temperature)
    if hidden:
        hs, ht = s.hidden_states[-1].float(), t.hidden_states[-1].float()
        loss = loss + cfg.hidden_weight * ((hs - ht).square().sum(-1) / ht.square().sum(-1).clamp_min(1e-12)).sum()
    return loss


def _optimizer(params: list, cfg: HealConfig):
    from transformers import get_cosine_schedule_with_warmup

    # the fused kernel: one pass over each weight's state, where the loop of foreach kernels takes several
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None)
    return opt, get_cosine_schedule_with_warmup(opt, round(cfg.warmup * cfg.steps), cfg.steps)


def distill(loaded: Loaded, teacher: torch.nn.Module, windows: HealWindows, cfg: HealConfig, *,
            resume_dir: Path | None = None, fingerprint: dict | None = None, progress: bool = True) -> dict:
    """Heal ``loaded`` in place from ``teacher`` over ``cfg.tokens`` tokens of ``windows``; saves its resume point
    in ``resume_dir`` (continued from there when one of this heal is found). Returns what it did."""
    device, w = loaded.device, world()
    model, named = learners(loaded, cfg)
    params = list(named.values())
    opt, sched = _optimizer(params, cfg)
    fingerprint = {**(fingerprint or {}), "heal": {**vars(cfg)}, "data": windows.describe()}
    start, losses, seconds = 0, [], 0.0
    if (st := saved.load(resume_dir, fingerprint)) is not None:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(st["params"][n])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["schedule"])
        start, losses, seconds = st["step"], st["losses"], st["seconds"]
    mode = precision(device, cfg.precision)
    rows, tokens = share(cfg.batch, w), cfg.batch * cfg.seqlen
    ctx = (lambda: bf16.autocast(device)) if mode == "bf16" else contextlib.nullcontext
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="heal", unit="step",
               disable=not progress or w.rank > 0)
    began = last_save = time.perf_counter()
    for step in bar:
        ids = windows.batch(step, cfg.batch, rows).to(device)
        with ctx():
            loss = _loss(model, teacher, ids, cfg) if ids.numel() else torch.zeros((), requires_grad=True)
        (loss / tokens).backward()
        grads_sum_(params)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(all_sum(loss.item()) / tokens)
        now = time.perf_counter()
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{(step + 1 - start) * tokens / (now - began):.0f}")
        if now - last_save >= SAVE_SECONDS or step + 1 == cfg.steps:
            _save(resume_dir, fingerprint, named, opt, sched, step + 1, losses, seconds + now - began)
            last_save = now
    seconds += time.perf_counter() - began
    trainable = sum(p.numel() for p in params)
    if cfg.train == "lora":
        model.merge_and_unload()  # the adapters folded into the weights: a stock checkpoint again
    loaded.model.requires_grad_(False)
    return _report(cfg, mode, windows, losses, seconds, trainable)


def _save(folder, fingerprint, named, opt, sched, step, losses, seconds) -> None:
    if folder is None or world().rank > 0:  # every rank holds the same weights: rank 0 writes them
        return
    saved.save(folder, {"fingerprint": fingerprint, "params": {n: p.detach().cpu() for n, p in named.items()},
                        "optimizer": opt.state_dict(), "schedule": sched.state_dict(), "step": step,
                        "losses": losses, "seconds": seconds})


def _report(cfg: HealConfig, mode: str, windows: HealWindows, losses: list, seconds: float, trainable: int) -> dict:
    tokens = cfg.steps * cfg.batch * cfg.seqlen
    head, tail = losses[:5], losses[-5:]
    every = max(1, len(losses) // 100)
    return {**{k: v for k, v in vars(cfg).items() if k != "data"}, "tokens": tokens, "steps": cfg.steps,
            "precision": mode, "trainable_params": trainable, "data": windows.describe(), "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "loss": {"first": sum(head) / len(head), "last": sum(tail) / len(tail), "every": every,
                     "curve": losses[::every]}}
