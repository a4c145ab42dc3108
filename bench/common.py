"""What the bench scripts share: random-weight checkpoints and random calibration tokens (no model files needed),
the dense MLP inputs of chosen layers, the arguments several scripts take, and a CUDA-aware clock edge.

Not a benchmark: each script imports it from its own folder (``python bench/<script>.py`` puts bench/ on the path).
"""
from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

import torch

from spap_lib.evaluation.data import Calibration
from spap_lib.model.capture import capture_inputs

RANDOM_NOTE = "; random weights and random tokens: the times hold, the errors are those of random layers"


def random_checkpoint(alias: str, layers: int, device: torch.device, shrink: dict | None = None) -> Path:
    """A checkpoint of ``alias``'s shapes with ``layers`` decoder layers of random weights (seed 0) in the dtype
    ``sl.load`` gives it on ``device``, saved once as safetensors under bench/.cache (with a placeholder
    tokenizer: calibration uses random tokens), so every offload mode loads the same weights from the same files.
    ``shrink``: config fields set over the shipped ones (the same architecture at tiny widths, for dry runs)."""
    from transformers import AutoModelForCausalLM

    from spap_lib.files import REPO, atomic_dir
    from spap_lib.model.dtypes import pick_dtype
    from spap_lib.model.loading import read_config, resolve
    from spap_lib.plan import shipped_config

    dtype = pick_dtype("auto", device)  # the dtype ``sl.load`` gives it on ``device``
    kind = "tiny" if shrink else "random"
    path = REPO / "bench" / ".cache" / f"{kind}-{alias}-{layers}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").is_file():
        return path
    config = shipped_config(alias) or read_config(resolve(alias))
    config.update(shrink or {})
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        placeholder_tokenizer().save_pretrained(tmp)
    return path


def random_gguf(alias: str, layers: int, like: str) -> Path:
    """A GGUF of ``alias``'s shapes with ``layers`` decoder layers of random weights that copies the metadata of
    the real GGUF ``like`` (an alias or path): its vocabulary and tokenizer, so loading it parses what a real file
    makes a load parse. Each tensor takes the quantization type of its role in ``like`` where gguf can quantize
    it, else Q8_0 (the K-quants). Written once under bench/.cache; the head is stored apart if ``like``'s is."""
    import hashlib

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, quantize

    from spap_lib.files import REPO
    from spap_lib.model.loading import resolve
    from spap_lib.plan import shipped_config

    source = resolve(like)
    real = Path(source.path) / source.gguf_file if source.kind == "gguf" else Path(like)
    tag = hashlib.sha256(f"{real.name}:{real.stat().st_size}".encode()).hexdigest()[:8]
    path = REPO / "bench" / ".cache" / f"random-{alias}-{layers}-like-{tag}.gguf"
    if path.is_file():
        return path
    c = shipped_config(alias)
    reader = GGUFReader(real)
    arch = reader.fields["general.architecture"].contents()
    shape_keys = {f"{arch}.{k}": v for k, v in {
        "block_count": layers, "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
        "rope.freq_base": float(c.rope_parameters["rope_theta"]), "context_length": c.max_position_embeddings}.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = shape_keys.pop(key, None)
        value = field.contents() if value is None else value
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    types = {".".join(t.name.split(".")[2:] if t.name.startswith("blk.") else [t.name]): t.tensor_type
             for t in reader.tensors}  # a role's type: the last layer's
    rng = np.random.default_rng(0)
    d, f, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * hd
    block = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (d, d), "attn_q.bias": (d,),
             "attn_k.weight": (kv, d), "attn_k.bias": (kv,), "attn_v.weight": (kv, d), "attn_v.bias": (kv,),
             "attn_output.weight": (d, d), "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d),
             "ffn_down.weight": (d, f)}
    tensors = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,),
               **({"output.weight": (c.vocab_size, d)} if "output.weight" in types else {}),
               **{f"blk.{i}.{role}": shape for i in range(layers) for role, shape in block.items() if role in types}}
    for name, shape in tensors.items():
        role = name.split(".", 2)[2] if name.startswith("blk.") else name
        w = np.ones(shape, np.float32) if role.endswith("norm.weight") else \
            rng.normal(0, 0.02, shape).astype(np.float32)
        qtype = types[role] if types[role] in (Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0) else Q.Q8_0
        writer.add_tensor(name, w if qtype == Q.F32 else quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def placeholder_tokenizer():
    """A one-token tokenizer for a random checkpoint: it calibrates on random tokens, but a checkpoint needs one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   unk_token="<unk>")


def random_calibration(vocab_size: int, nsamples: int, seqlen: int, seed: int) -> Calibration:
    """``nsamples`` windows of uniformly random tokens: a random model's calibration set (seeded)."""
    windows = torch.randint(0, vocab_size, (nsamples, seqlen), generator=torch.Generator().manual_seed(seed))
    return Calibration(windows, [0] * nsamples, "random tokens", "random", windows.numel(), seed)


@torch.no_grad()
def mlp_inputs(loaded, windows: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """Dense MLP inputs of the chosen layers (whole-model forwards; fine for a tuning script)."""
    mods = [loaded.adapter.mlp_input_module(loaded.adapter.layers()[i]) for i in layers]
    with ExitStack() as stack:
        seen = [stack.enter_context(capture_inputs(m)) for m in mods]
        for w in windows:
            loaded.model(input_ids=w[None].to(loaded.device), use_cache=False)
    return {i: torch.cat(store).float() for i, store in zip(layers, seen)}


def device_arguments(ap: argparse.ArgumentParser) -> None:
    """``--device`` and ``--random``: where a benchmark prunes, and whether on random layers of the model's shapes."""
    ap.add_argument("--device", default="cpu", help="where the layers are pruned ('auto': CUDA where there is one)")
    ap.add_argument("--random", action="store_true",
                    help="random weights of the model's shipped config and random tokens: no model files needed; "
                         "the times hold, the errors are those of random layers")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every per-layer bench shares (``bench/tune.py`` and ``bench/layers.py``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--sparsity", type=float, default=0.2)
    return ap
