"""Layer-level checkpoints of a sequential prune: a run that stops (a session's end, a preempted GPU)
resumes at the first layer it had not finished, with the same result.

After every layer the folder receives that layer's pruned MLP tensors (``layer_NNN.safetensors``) and
the calibration activations the next layer starts from (``hidden.bin``, written batch by batch, so a
spilled store never has to fit in memory); ``state.json``, replaced atomically last, is the commit point.
A folder made by a different run (model, method, hyperparameters, budget, calibration, device) is
refused, naming what differs, rather than mixed into this one. Resuming gives the same weights: each
layer's randomness is seeded by its index, and the activations are stored exactly.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .adapters import MLP
from .checks import ParameterError
from .io import write_json_atomic

STATE = "state.json"


class LayerCheckpoint:
    def __init__(self, folder: str | os.PathLike, fingerprint: dict):
        self.folder, self.fingerprint = Path(folder), json.loads(json.dumps(fingerprint, sort_keys=True, default=str))

    def load(self) -> dict | None:
        """The finished layers' state, or None if nothing was finished; refuses another run's folder."""
        path = self.folder / STATE
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        if state["fingerprint"] != self.fingerprint:
            differ = sorted(k for k in {*state["fingerprint"], *self.fingerprint}
                            if state["fingerprint"].get(k) != self.fingerprint.get(k))
            raise ParameterError(f"{self.folder} holds the layers of another run (differs in {', '.join(differ)}); "
                                 f"delete it or resume with the same settings")
        return state

    def save(self, i: int, mlp: MLP, hidden, batch_size: int, per_layer: list, kept: list) -> None:
        """Layer ``i`` is finished: its pruned MLP, the next layer's inputs, then the commit point."""
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"W_in.{k}": W.contiguous() for k, W in enumerate(mlp.W_in)}
        tensors.update({f"b_in.{k}": b.contiguous() for k, b in enumerate(mlp.b_in) if b is not None})
        tensors["W_out"] = mlp.W_out.contiguous()
        if mlp.b_out is not None:
            tensors["b_out"] = mlp.b_out.contiguous()
        tmp = self.folder / f".layer_{i:03d}.tmp"
        save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, self.folder / f"layer_{i:03d}.safetensors")
        tmp = self.folder / ".hidden.tmp"
        with open(tmp, "wb") as f:  # batch by batch: a spilled store is never read whole
            for s in range(0, hidden.shape[0], batch_size):
                f.write(hidden[s:s + batch_size].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, self.folder / "hidden.bin")
        write_json_atomic(self.folder / STATE, {
            "fingerprint": self.fingerprint, "next": i + 1, "per_layer": per_layer, "kept": kept,
            "hidden": {"shape": list(hidden.shape), "dtype": str(hidden.dtype).removeprefix("torch.")}})

    def layer(self, i: int, like: MLP) -> MLP:
        """Layer ``i``'s pruned MLP (activation and layout from ``like``, the dense one)."""
        from safetensors.torch import load_file

        t = load_file(str(self.folder / f"layer_{i:03d}.safetensors"), device=str(like.W_out.device))
        n = len(like.W_in)
        return MLP(W_in=[t[f"W_in.{k}"] for k in range(n)], b_in=[t.get(f"b_in.{k}") for k in range(n)],
                   W_out=t["W_out"], b_out=t.get("b_out"), act=like.act, glu=like.glu)

    def hidden(self, state: dict, store, batch_size: int):
        """The saved activations, written batch by batch into ``store(shape, dtype)``."""
        shape, dtype = state["hidden"]["shape"], getattr(torch, state["hidden"]["dtype"])
        out = store(tuple(shape), dtype)
        row = int(torch.tensor([], dtype=dtype).element_size() * torch.Size(shape[1:]).numel())
        with open(self.folder / "hidden.bin", "rb") as f:
            for s in range(0, shape[0], batch_size):
                n = min(batch_size, shape[0] - s)
                buf = bytearray(f.read(n * row))
                out[s:s + n] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(n, *shape[1:])
        return out

    def clear(self) -> None:
        """The run finished: its layers are in the model, the folder goes."""
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
