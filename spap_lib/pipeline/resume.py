"""Layer-level checkpoints of a sequential prune: a run that stops (a time limit, a preempted GPU)
resumes at the first layer it had not finished, with the same result.

After every layer the folder receives that layer's pruned MLP tensors (``layer_NNN.safetensors``) and
the calibration activations the next layer starts from (``hidden_NNN.bin``, written batch by batch, so a
spilled store never has to fit in memory); ``state.json``, replaced atomically last, is the commit point.
The fingerprint includes a hash of the method's and the numerics' source, so layers pruned by other
code are not reused.
A folder made by a different run (model, method, hyperparameters, budget, calibration, device) is
refused, naming what differs, rather than mixed into this one. Resuming gives the same weights: each
layer's randomness is seeded by its index, and the activations are stored exactly.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from spap_lib.checks import ParameterError
from spap_lib.errors import OutputError
from spap_lib.files import write_json_atomic
from spap_lib.keys import sha256_of
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import barrier, gather_objects, world

STATE = "state.json"


def _ours(name: str) -> bool:
    return name == STATE or (name.startswith((".", "layer_", "hidden_", "heal_"))
                             and name.endswith((".safetensors", ".bin", ".pt", ".tmp")))


def _read_state(folder: Path) -> dict | None:
    """``state.json`` of a resume folder, or None if there is none; refuses one spap did not write."""
    path = folder / STATE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ParameterError(f"resume folder {folder}: {path} is unreadable ({err}); delete {path} (the finished "
                             "layers are then redone) or the folder") from None
    if not isinstance(state, dict) or not {"fingerprint", "next", "hidden"} <= set(state):
        raise ParameterError(f"resume folder {folder} holds a {STATE} that spap did not write: give a new or "
                             "empty folder for the finished layers")
    return state


def _differ(saved: dict, expect: dict) -> list[str]:
    """The settings that differ; an expected dict is compared by its own keys (``calibration.nsamples``), so a check
    made before loading compares what it knows of a setting (the calibration's size, not its windows' digest)."""
    differ = []
    for k, want in expect.items():
        have = saved.get(k)
        if isinstance(want, dict) and isinstance(have, dict):
            differ += [f"{k}.{kk}" for kk in want if have.get(kk) != want[kk]]
        elif have != want:
            differ.append(k)
    return sorted(differ)


def _value(fingerprint: dict, name: str):
    top, _, sub = name.partition(".")
    value = fingerprint.get(top)
    return value.get(sub) if sub and isinstance(value, dict) else value


def _values(saved: dict, expect: dict, differ: list[str]) -> str:
    """``key: saved -> this run's`` for each difference (long values cut), so the user sees which setting moved."""
    def short(v):
        text = json.dumps(v, sort_keys=True, default=str)
        return text if len(text) <= 60 else text[:57] + "..."
    return "; ".join(f"{k}: {short(_value(saved, k))} there, {short(_value(expect, k))} now" for k in differ[:4])


def _another_run(folder: Path, differ: list[str], saved: dict | None = None,
                 expect: dict | None = None) -> ParameterError:
    """The refusal of a folder whose layers this run must not reuse, naming what differs."""
    if "code" in differ and (saved or {}).get("code") is not None:  # other source: another spap, an edited method
        rest = [k for k in differ if k != "code"]
        return ParameterError(
            f"{folder} holds layers pruned by other code (spap's method, numerics or pipeline source differs: "
            f"another version of spap{', and ' + ', '.join(rest) if rest else ''}); they cannot be reused: delete "
            "the folder and the prune starts from the first layer")
    shown = f" ({_values(saved, expect, differ)})" if saved is not None and expect is not None else ""
    return ParameterError(f"{folder} holds the layers of another run (differs in {', '.join(differ)}{shown}); "
                          "delete it or resume with the same settings")


def _run_lock(folder: Path):
    """The lock a run holds on its resume folder while it prunes (rank 0's, for all its ranks): beside the folder,
    which is removed when the run is done."""
    from filelock import FileLock

    # one lock object per path in a process (reentrant): a run interrupted in a notebook does not lock out the next
    return FileLock(folder.with_name(f".{folder.name}.spap-run.lock"), timeout=0, is_singleton=True)


def _in_use(folder: Path) -> ParameterError:
    return ParameterError(f"resume folder {folder} is in use by another prune running now: wait for it to finish "
                          "(it resumes nothing of this run's), or give this run another resume folder")


def _check_not_in_use(folder: Path) -> None:
    from filelock import Timeout

    if not folder.parent.is_dir():
        return
    try:
        with _run_lock(folder):
            pass
    except Timeout:
        raise _in_use(folder) from None


def check_folder(folder: str | os.PathLike, expect: dict | None = None, *, in_use: bool = True) -> str:
    """What a resume folder holds, checked before any work: ``new``, ``empty``, ``restart`` (files of ours
    but no commit yet: an interrupted first layer, started again) or ``resume`` (finished layers of this
    run). A file, a foreign folder, a foreign or corrupt ``state.json`` and the layers of another run
    (``expect``: the fingerprint's keys known so far, compared as stored) are refused, naming the fix."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ParameterError(f"resume folder {folder} is a file: give a directory (new or empty) for the "
                             "finished layers")
    where = next(p for p in [folder.absolute(), *folder.absolute().parents] if p.exists())
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in the resume folder {folder} ({where} is read-only for this user): "
                          "give a folder you can write")
    if in_use and world().rank == 0:  # rank 0 holds the lock for all its ranks (``LayerCheckpoint``)
        _check_not_in_use(folder)
    if not folder.exists():
        return "new"
    state = _read_state(folder)
    if state is None:
        names = [p.name for p in folder.iterdir()]
        if not names:
            return "empty"
        if all(_ours(name) for name in names):
            return "restart"
        raise ParameterError(f"resume folder {folder} is not empty and holds no {STATE} (it holds "
                             f"{', '.join(sorted(names)[:5])}): give a new or empty folder (spap writes layer files "
                             "there and removes them when done)")
    expect = json.loads(json.dumps(expect or {}, sort_keys=True, default=str))
    differ = _differ(state["fingerprint"], expect)
    if differ:
        raise _another_run(folder, differ, state["fingerprint"], expect)
    verify(folder, state)
    return "resume"


def verify(folder: Path, state: dict) -> None:
    """Every file the commit point names is there with the content it recorded (a partial copy of a
    pre-empted job's folder, a damaged disk): otherwise a refusal naming the file, before any work."""
    for name, sha in state.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise ParameterError(f"resume folder {folder} lacks {name}, which its {STATE} lists (an incomplete "
                                 "copy?): copy the whole folder again, or delete it and the prune starts from the "
                                 "first layer")
        if sha256_of(path) != sha:
            raise ParameterError(f"resume folder {folder}: {name} is damaged (its sha256 differs from the one "
                                 f"{STATE} recorded): copy the folder again, or delete it and the prune starts "
                                 "from the first layer")


class LayerCheckpoint:
    def __init__(self, folder: str | os.PathLike, fingerprint: dict, clear_when_done: bool = True):
        self.folder, self.fingerprint = Path(folder), json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        self.clear_when_done = clear_when_done
        # Only a folder of ours is ever written or cleared: never a user's directory given by mistake.
        found = check_folder(self.folder, in_use=False)
        self._lock = None
        if world().rank == 0:
            self._hold()
            if found == "restart":  # killed before its first commit
                clear_folder(self.folder)
        barrier()  # ranks share the folder: none writes before rank 0 has cleared it

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        """The prune ended, finished or not: the folder is free for the next run (a resumed one)."""
        if self._lock is not None and self._lock.is_locked:
            self._lock.release()

    def _hold(self) -> None:
        """Rank 0 holds the folder's run lock until the run is done or its process ends: another run given the
        same folder meanwhile is refused up front (``check_folder``), not mixed into this one."""
        from filelock import Timeout

        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _run_lock(self.folder)
        try:
            self._lock.acquire()
        except Timeout:
            raise _in_use(self.folder) from None

    def load(self) -> dict | None:
        """The finished layers' state, or None if nothing was finished; refuses another run's folder."""
        state = _read_state(self.folder)
        if state is None:
            return None
        differ = _differ(state["fingerprint"], self.fingerprint) + \
            [k for k in state["fingerprint"] if k not in self.fingerprint]
        if differ:
            raise _another_run(self.folder, differ, state["fingerprint"], self.fingerprint)
        verify(self.folder, state)
        seen = gather_objects(state["next"])
        if len(set(seen)) > 1:  # a folder on each node's own disk, not one every rank reads
            raise ParameterError(f"the ranks read different resume folders at {self.folder} (finished layers: "
                                 f"{seen}): give a --resume-dir on a file system every rank shares")
        return state

    def save(self, i: int, mlp: MLP, hidden, batch_size: int, per_layer: list, kept: list) -> None:
        """Layer ``i`` is finished: its pruned MLP, the next layer's inputs, then the commit point. A full disk
        or a folder that became read-only is a refusal naming the folder (the layers committed so far stay)."""
        from safetensors import SafetensorError

        try:
            self._save(i, mlp, hidden, batch_size, per_layer, kept)
        except (OSError, SafetensorError) as err:
            why = getattr(err, "strerror", None) or str(err)
            raise OutputError(f"cannot save layer {i} in the resume folder {self.folder} ({why}): free space there "
                              "or give a resume folder on a larger disk; rerunning resumes after the last saved "
                              "layer") from None

    def _save(self, i: int, mlp: MLP, hidden, batch_size: int, per_layer: list, kept: list) -> None:
        if world().parallel:
            return self._save_ranks(i, mlp, hidden, batch_size, per_layer, kept)
        self.folder.mkdir(parents=True, exist_ok=True)
        layer_sha = self._save_layer(i, mlp)
        # The next layer's inputs under their own name: until state.json says so, the previous file stays
        # the one a resume reads (a kill between the two writes cannot pair layer i with i+1's inputs).
        hidden_file = self._save_hidden(f"hidden_{i + 1:03d}.bin", hidden, batch_size)
        self._commit(i, per_layer, kept, {f"layer_{i:03d}.safetensors": layer_sha}, hidden_file)
        self._drop_older(hidden_file["file"], "hidden_*.bin")

    def _save_ranks(self, i: int, mlp: MLP, hidden, batch_size: int, per_layer: list, kept: list) -> None:
        """The same commit across ranks sharing the folder: rank 0 the layer, every rank its own share of the next
        layer's inputs; once all are written rank 0 commits ``state.json``, and only then does any rank delete its
        older inputs (a kill at any point leaves one consistent commit)."""
        w = world()
        self.folder.mkdir(parents=True, exist_ok=True)
        layer = {f"layer_{i:03d}.safetensors": self._save_layer(i, mlp)} if w.rank == 0 else {}
        mine = self._save_hidden(f"hidden_{i + 1:03d}.rank{w.rank}of{w.size}.bin", hidden, batch_size)
        every = gather_objects(mine)  # also the barrier: every rank's file is written
        if w.rank == 0:
            self._commit(i, per_layer, kept, layer, every)
        barrier()
        self._drop_older(mine["file"], f"hidden_*.rank{w.rank}of{w.size}.bin")

    def _save_layer(self, i: int, mlp: MLP) -> str:
        from safetensors.torch import save_file

        tensors = {f"W_in.{k}": W.contiguous() for k, W in enumerate(mlp.W_in)}
        tensors.update({f"b_in.{k}": b.contiguous() for k, b in enumerate(mlp.b_in) if b is not None})
        tensors["W_out"] = mlp.W_out.contiguous()
        if mlp.b_out is not None:
            tensors["b_out"] = mlp.b_out.contiguous()
        tmp = self.folder / f".layer_{i:03d}.tmp"
        save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(tmp))
        layer_sha = sha256_of(tmp)
        os.replace(tmp, self.folder / f"layer_{i:03d}.safetensors")
        return layer_sha

    def _save_hidden(self, name: str, hidden, batch_size: int) -> dict:
        tmp = self.folder / f".{name}.tmp"
        digest = hashlib.sha256()
        with open(tmp, "wb") as f:  # batch by batch: a spilled store is never read whole
            for s in range(0, hidden.shape[0], batch_size):
                block = hidden[s:s + batch_size].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                digest.update(block)
                f.write(block)
        os.replace(tmp, self.folder / name)
        return {"file": name, "sha256": digest.hexdigest(), "shape": list(hidden.shape),
                "dtype": str(hidden.dtype).removeprefix("torch.")}

    def _commit(self, i: int, per_layer: list, kept: list, layer: dict, hidden: dict | list[dict]) -> None:
        """``state.json``, the commit point: the files so far (older inputs dropped) and where the next layer's
        inputs are (``hidden``: one file's entry, or every rank's in rank order)."""
        state = _read_state(self.folder) if i else None
        files = {k: v for k, v in (state or {}).get("files", {}).items() if not k.startswith("hidden_")}
        entries = hidden if isinstance(hidden, list) else [hidden]
        files.update({**layer, **{h["file"]: h["sha256"] for h in entries}})
        where = [{k: v for k, v in h.items() if k != "sha256"} for h in entries]
        write_json_atomic(self.folder / STATE, {
            "fingerprint": self.fingerprint, "next": i + 1, "per_layer": per_layer, "kept": kept, "files": files,
            "hidden": where if isinstance(hidden, list) else where[0]})

    def _drop_older(self, name: str, pattern: str) -> None:
        for old in self.folder.glob(pattern):  # committed: earlier inputs are not needed any more
            if old.name != name:
                old.unlink(missing_ok=True)

    def layer(self, i: int, like: MLP) -> MLP:
        """Layer ``i``'s pruned MLP (activation and layout from ``like``, the dense one)."""
        from safetensors.torch import load_file

        t = load_file(str(self.folder / f"layer_{i:03d}.safetensors"), device=str(like.W_out.device))
        n = len(like.W_in)
        return MLP(W_in=[t[f"W_in.{k}"] for k in range(n)], b_in=[t.get(f"b_in.{k}") for k in range(n)],
                   W_out=t["W_out"], b_out=t.get("b_out"), act=like.act, glu=like.glu)

    def hidden(self, state: dict, store, batch_size: int):
        """The saved activations (this rank's share, in a data-parallel prune), written batch by batch into
        ``store(shape, dtype)``."""
        entry = state["hidden"][world().rank] if isinstance(state["hidden"], list) else state["hidden"]
        shape, dtype = entry["shape"], getattr(torch, entry["dtype"])
        out = store(tuple(shape), dtype)
        row = int(torch.tensor([], dtype=dtype).element_size() * torch.Size(shape[1:]).numel())
        with open(self.folder / entry["file"], "rb") as f:
            for s in range(0, shape[0], batch_size):
                n = min(batch_size, shape[0] - s)
                buf = bytearray(f.read(n * row))
                out[s:s + n] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(n, *shape[1:])
        return out

    def clear(self) -> None:
        """The run finished: its layers are in the model; our files go (rank 0's job), then the folder if empty."""
        barrier()
        if world().rank == 0:
            clear_folder(self.folder)


def clear_folder(folder: str | os.PathLike) -> None:
    """Remove spap's files from a resume folder, then the folder if that left it empty (never a user's files)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if _ours(path.name):
            path.unlink()
    if not any(folder.iterdir()):
        folder.rmdir()


def code_modules(method) -> list:
    """The source that decides a layer's result: the modules of the method's class and of every class it
    derives from (a preset's parent holds its algorithm), every module of the methods package those draw on,
    the modules of the parts the method composes (``parts()``: a selection or an update registered beside its
    maths, the penalty method's or the rounds'), the channel statistics, the allocations, the numerics and the
    pipeline."""
    import inspect

    from spap_lib.methods.parts import allocation
    from spap_lib.methods.parts import (
        selection as parts,  # its registries name no module, so the search below may not find it
    )
    from spap_lib.numerics import linalg, stats
    from spap_lib.pipeline import sequential as pipeline

    registries = {"select": parts.SELECTIONS, "update": parts.UPDATES, "allocation": allocation.ALLOCATIONS}
    # a part the method names but no registry holds (FLAP's bias compensation) is its class's own code
    chosen = [registries[kind][name] for kind, name in method.parts().items() if name in registries[kind]]
    own = [inspect.getmodule(c) for c in type(method).__mro__ if c.__module__.startswith("spap_lib.")]
    own += [inspect.getmodule(v) for part in chosen for v in vars(part).values() if callable(v)]
    own += [inspect.getmodule(part.settings) for part in chosen if part.settings is not None]
    found = list(dict.fromkeys(m for m in own if m is not None and m.__name__.startswith("spap_lib.")))
    for module in found:  # grows as it goes: what a found module imports from the package is searched too
        for value in vars(module).values():
            source = inspect.getmodule(value)
            if source is not None and source.__name__.startswith("spap_lib.methods.") and source not in found:
                found.append(source)
    return list(dict.fromkeys([*found, parts, stats, allocation, linalg, pipeline]))


def code_hash(method) -> str:
    """A short hash of ``code_modules`` of a method instance: layers pruned by other code are not reused; edits
    elsewhere do not invalidate."""
    from spap_lib.keys import code_digest

    return code_digest(*code_modules(method))
