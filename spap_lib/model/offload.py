"""Where the weights live while a model is pruned or evaluated: the device, host memory, or disk.

The sequential pipeline only ever needs one decoder layer on the device, so the rest of the model
can wait elsewhere (llm-compressor's sequential onloading). An ``Onloader`` hands the pipeline one
layer at a time and takes it back:

* ``none``: everything resident on the device (small models; the fastest).
* ``cpu``:  the model in host memory; ``layer(i)`` moves decoder layer ``i`` to the device and back.
  The hidden states between layers live in host memory too and go to the device one batch at a time.
* ``disk``: the model skeleton on the meta device (accelerate's ``init_empty_weights``: no memory);
  ``layer(i)`` reads layer ``i``'s tensors lazily from the source files (safetensors through
  ``safe_open``; GGUF tensor by tensor through the ``gguf`` reader and dequantizer, so a GGUF is
  never dequantized whole) and writes them into the skeleton with accelerate's
  ``set_module_tensor_to_device``; on the way back the layer returns to meta. A pruned layer is
  written to a spill folder of safetensors shards as soon as it is finished, and later onloads of
  it read the spill; ``save`` assembles the checkpoint from those shards. The hidden states between
  layers wait in spill files too (``SpilledActivations``), read and written a batch at a time. Only
  the embeddings, final norm and head are in host memory for the whole run.

Why not accelerate's ``cpu_offload``/``disk_offload`` hooks: they move weights around every
*forward*, while the pipeline holds a layer for many forwards and replaces its Linear modules
(pruning changes the shapes); one explicit context per layer is simpler and cannot leak.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from spap_lib.checks import ParameterError
from spap_lib.files import HOST, process_alive
from spap_lib.model.stores import SafetensorsStore
from spap_lib.numerics.memory import release_freed

OFFLOADS = ("auto", "none", "cpu", "disk")


SPILL_PREFIX = ".spap-spill-"


def check_offload(offload: str) -> str:
    if offload not in OFFLOADS:
        raise ParameterError(f"unknown offload {offload!r}: use one of {', '.join(OFFLOADS)} (none: all on the device; "
                             "cpu: weights in host memory, one layer on the device; disk: weights read layer by layer "
                             "from the model files; auto: the fastest that the plan says fits)")
    return offload


def remove_dead_spills(root: Path) -> None:
    """Spill folders of processes on this host that no longer run (killed mid-prune) are removed."""
    for entry in root.glob(f"{SPILL_PREFIX}{HOST}-*-*"):
        pid = entry.name[len(SPILL_PREFIX) + len(HOST) + 1:].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


# -- onloaders ---------------------------------------------------------------------------------
def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


class Onloader:
    """Resident: every weight already on the device (``offload="none"``)."""

    mode: ClassVar[str] = "none"
    streams: ClassVar[bool] = False  # whether hidden states wait off the device between layers

    def __init__(self, model: nn.Module, layers: nn.ModuleList, device: torch.device):
        self.model, self.layers, self.device = model, layers, torch.device(device)
        self.prefix = _layers_prefix(model, layers)

    def activations(self, shape: tuple[int, ...], dtype: torch.dtype):
        """Room for hidden states ``[n, seqlen, d]`` between layers, written and read a batch at a time:
        on the device here, in host memory when offloaded to ``cpu``, in a spill file for ``disk``."""
        return torch.empty(shape, dtype=dtype, device=self.device if not self.streams else "cpu")

    def calibration(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Room for a layer's MLP inputs ``X`` ``[N, d]`` (and, beside them, its dense targets ``Y``), which every
        pass of the solver reads a chunk at a time (``linalg.rows``): on the device, or in pinned host memory
        where the weights are offloaded from a GPU (``2·N·d·b`` that the device then does not hold; docs/scale.md:
        Memory per layer; pinned, so each chunk's copy runs at the link's full rate). Not in spill files with
        ``disk``: Adam's mini-batches gather random rows."""
        if not self.streams or self.device.type != "cuda":
            return torch.empty(shape, dtype=dtype, device=self.device)
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @contextmanager
    def layer(self, i: int):
        """Decoder layer ``i`` on the device for the duration of the block."""
        yield self.layers[i]

    def finished(self, i: int) -> None:
        """Layer ``i`` holds its final (pruned) weights: later onloads must see them."""

    @contextmanager
    def base(self):
        """Everything but the decoder layers (embeddings, rotary tables, final norm, head) on the device."""
        yield

    def round_weights(self, dtype: torch.dtype) -> None:
        """Round every weight to a value ``dtype`` holds, kept in the working dtype: the model then computes what
        its checkpoint, written in ``dtype``, computes when loaded in the working dtype. Idempotent."""
        for p in self.model.parameters():
            if not p.is_meta and p.is_floating_point() and p.dtype != dtype:
                p.data.copy_(p.data.to(dtype))

    def _base_names(self):
        inside = self.prefix + "."
        # a meta tensor is an embedding left in the store (``EmbeddingRows``): its rows go where its input is
        params = [n for n, p in self.model.named_parameters() if not n.startswith(inside) and not p.is_meta]
        buffers = [n for n, _ in self.model.named_buffers() if not n.startswith(inside)]
        return params + buffers

    def close(self) -> None:
        pass


class HostOffload(Onloader):
    """``offload="cpu"``: the model waits in host memory; one layer at a time on the device."""

    mode = "cpu"
    streams = True

    @contextmanager
    def layer(self, i: int):
        layer = self.layers[i]
        layer.to(self.device)
        try:
            yield layer
        finally:
            layer.to("cpu")  # also the Linear modules a pruning step put in
            release_freed()

    @contextmanager
    def base(self):
        from accelerate.utils import set_module_tensor_to_device

        names = self._base_names()
        for name in names:
            set_module_tensor_to_device(self.model, name, self.device)
        try:
            yield
        finally:
            for name in names:
                set_module_tensor_to_device(self.model, name, "cpu")


class DiskOffload(HostOffload):
    """``offload="disk"``: decoder layers read from ``store`` when onloaded, written to a spill folder
    when finished; the skeleton's layers stay on the meta device otherwise. Embeddings, final norm
    and head wait in host memory and are onloaded as with ``cpu`` (``base``)."""

    mode = "disk"
    streams = True

    def __init__(self, model, layers, device, store, dtype: torch.dtype, spill_dir: str | os.PathLike | None = None):
        super().__init__(model, layers, device)
        self.store, self.dtype = store, dtype
        root = Path(spill_dir) if spill_dir else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        remove_dead_spills(root)
        self.spill = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{HOST}-{os.getpid()}-", dir=root))
        self._spilled: dict[int, SafetensorsStore] = {}
        self._rounded_to: torch.dtype | None = None  # the dtype ``round_weights`` rewrote the spills in
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.spill, True)

    def activations(self, shape: tuple[int, ...], dtype: torch.dtype) -> SpilledActivations:
        return SpilledActivations(self.spill, shape, dtype)

    def _store(self, i: int):
        return self._spilled.get(i, self.store)

    def layer_names(self, i: int) -> list[str]:
        return [f"{self.prefix}.{i}.{n}" for n, _ in self.layers[i].named_parameters()]

    @contextmanager
    def layer(self, i: int):
        from accelerate.utils import set_module_tensor_to_device

        store = self._store(i)
        for name in self.layer_names(i):
            set_module_tensor_to_device(self.model, name, self.device, value=store.get(name, self.dtype))
        try:
            yield self.layers[i]
        finally:
            self.layers[i].to("meta")  # frees the weights; shapes (pruned ones too) stay
            release_freed()

    def finished(self, i: int) -> None:
        from safetensors.torch import save_file

        layer = self.layers[i]
        tensors = {f"{self.prefix}.{i}.{n}": p.detach().to("cpu").contiguous() for n, p in layer.named_parameters()}
        path = self.spill / f"layer-{i:05d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        self._spilled[i] = SafetensorsStore(self.spill, [path])

    def round_weights(self, dtype: torch.dtype) -> None:
        """As ``Onloader.round_weights``; finished layers are rewritten in ``dtype`` (each spill file replaced
        atomically), so the checkpoint links them as they are and every later onload reads the rounded values."""
        super().round_weights(dtype)
        rows = getattr(self.model.get_input_embeddings(), "spap_rows", None)
        if rows is not None:
            rows.rounding = dtype
        if dtype in (self.dtype, self._rounded_to):
            return  # the spills already hold these values, in the dtype they are saved in
        for i, store in self._spilled.items():
            self._spilled[i] = _respilled(store, i, dtype)
        self._rounded_to = dtype

    def spilled(self, i: int) -> tuple[Path, set[str]] | None:
        """Layer ``i``'s spill file and the tensor names in it, once it is finished."""
        return (self._spilled[i].folder / f"layer-{i:05d}.safetensors", self._spilled[i].names()) \
            if i in self._spilled else None

    def close(self) -> None:
        self._cleanup()


def _respilled(store: SafetensorsStore, i: int, dtype: torch.dtype) -> SafetensorsStore:
    from safetensors.torch import save_file

    path = store.folder / f"layer-{i:05d}.safetensors"
    tensors = {name: store.get(name, dtype) for name in store.names()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return SafetensorsStore(store.folder, [path])


class SpilledActivations:
    """Hidden states ``[n, ...]`` in a file of the spill folder (``offload="disk"``): ``a[i:j]`` reads
    rows i..j with ``pread``, ``a[i:j] = t`` writes them with ``pwrite``, so host memory holds one batch,
    not the ``n·seqlen·d`` values that sit between two layers (docs/scale.md: Memory per layer).

    The file is unlinked as soon as it is created: it disappears with its last handle, when this
    object is collected or the process dies, whatever happens.
    """

    def __init__(self, folder: str | os.PathLike, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cpu")
        self._row = int(torch.Size(shape[1:]).numel()) * torch.empty((), dtype=dtype).element_size()
        fd, path = tempfile.mkstemp(prefix="hidden-", dir=folder)
        os.unlink(path)
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)
        os.ftruncate(fd, self.shape[0] * self._row)

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, key) -> tuple[int, int]:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"spilled activations are read and written by contiguous row ranges, not {key!r}")
        start, stop, _ = key.indices(self.shape[0])
        return start, max(start, stop)

    def __getitem__(self, key) -> torch.Tensor:
        start, stop = self._rows(key)
        buf = bytearray((stop - start) * self._row)
        view, offset = memoryview(buf), start * self._row
        while view:  # pread may return fewer bytes than asked (large reads)
            got = os.preadv(self._fd, [view], offset)
            if got == 0:
                raise OSError(f"spilled activations: unexpected end of file at byte {offset}")
            view, offset = view[got:], offset + got
        out = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return out.view(self.dtype).reshape(stop - start, *self.shape[1:])

    def __setitem__(self, key, value: torch.Tensor) -> None:
        start, stop = self._rows(key)
        if tuple(value.shape) != (stop - start, *self.shape[1:]):
            raise ValueError(f"rows {start}:{stop} of {tuple(self.shape)} cannot take a tensor of shape "
                             f"{tuple(value.shape)}")
        # flat bytes, so a partial write resumes at the right byte
        data = memoryview(value.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).reshape(-1).numpy())
        offset = start * self._row
        while data:
            written = os.pwrite(self._fd, data, offset)
            data, offset = data[written:], offset + written


def first_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter that holds data: input embeddings left in the store
    (``EmbeddingRows``) are a meta tensor between forwards."""
    return next(p.device for p in model.parameters() if not p.is_meta)


def load_base(model: nn.Module, onloader: Onloader, store, dtype: torch.dtype) -> None:
    """Read every tensor outside the decoder layers from ``store`` into host memory (tied weights once), but for
    input embeddings that are not the head: those stay in the store, read a batch's rows at a time
    (``EmbeddingRows``)."""
    from accelerate.utils import set_module_tensor_to_device

    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in model.named_parameters():
        if name.startswith(onloader.prefix + "."):
            continue
        if tied and head is not None and param is head.weight and name not in store:
            continue  # a tied head is not in the files: tie_weights() below points it at the embedding
        if name not in store:
            raise ParameterError(f"{name} is missing from the model files ({store.describe()}): "
                                 "the checkpoint does not match its config")
        if param is embedding.weight and isinstance(embedding, nn.Embedding) and not tied:
            EmbeddingRows(embedding, store, name, dtype)
            continue
        set_module_tensor_to_device(model, name, "cpu", value=store.get(name, dtype))
    model.tie_weights()
    release_freed()  # the dequantization temporaries of a large vocabulary's embeddings (docs/scale.md: Same answer)


class EmbeddingRows:
    """Input embeddings left in the store: each forward reads only the rows of its batch's distinct tokens and
    looks the batch up in them, the same values as a lookup in the whole matrix. Between forwards the weight is
    the skeleton's meta tensor (its shape counts the parameters; nothing else may read it)."""

    def __init__(self, module: nn.Embedding, store, name: str, dtype: torch.dtype):
        self.store, self.name, self.dtype = store, name, dtype
        self.rounding: torch.dtype | None = None  # the dtype a checkpoint saves them in (``round_weights``)
        self.placeholder, self.padding_idx = module.weight, module.padding_idx
        module.register_forward_pre_hook(self.read)
        module.register_forward_hook(self.drop)
        module.spap_rows = self  # write_checkpoint_weights reads the whole matrix back from the store

    def read(self, module: nn.Embedding, args: tuple) -> tuple:
        ids = args[0]
        distinct, where = torch.unique(ids, return_inverse=True)
        rows = self.store.rows(self.name, distinct.cpu(), self.dtype)
        if self.rounding is not None:
            rows = rows.to(self.rounding).to(self.dtype)
        rows = rows.to(ids.device)
        module._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        module.padding_idx = None  # an index into the whole vocabulary; only gradients read it
        return (where, *args[1:])

    def drop(self, module: nn.Embedding, args: tuple, output: torch.Tensor) -> None:
        module._parameters["weight"], module.padding_idx = self.placeholder, self.padding_idx


def write_checkpoint_weights(model: nn.Module, onloader: DiskOffload, folder: Path, dtype: torch.dtype) -> None:
    """A sharded safetensors checkpoint in ``dtype`` from a disk-offloaded model: one shard per decoder layer (the
    spill files, rewritten in ``dtype`` by ``round_weights`` and hard-linked or copied) and one for the rest, with
    the index stock loading reads."""
    from safetensors.torch import save_file

    onloader.round_weights(dtype)

    folder = Path(folder)
    weight_map, total = {}, 0
    # named_parameters() lists a tied head once (under the embedding's name), as save_pretrained writes it.
    rows = getattr(model.get_input_embeddings(), "spap_rows", None)  # embeddings left in the store
    base = {name: p.detach().to("cpu", dtype).contiguous() for name, p in model.named_parameters()
            if not name.startswith(onloader.prefix + ".") and not p.is_meta}

    def shard(file: str, tensors: dict) -> None:
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        nonlocal total
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    shard("model-base.safetensors", base)
    if rows is not None:  # a shard of their own, read as it is written: never beside the rest
        shard("model-embeddings.safetensors", {rows.name: rows.store.get(rows.name, dtype)})
    for i in range(len(onloader.layers)):
        spilled = onloader.spilled(i)
        if spilled is None:
            raise RuntimeError(f"layer {i} was never finished: no pruned weights to save")
        src, names = spilled
        dst = folder / f"model-layer-{i:05d}.safetensors"
        try:
            os.link(src, dst)  # same file system: no copy
        except OSError:
            shutil.copyfile(src, dst)
        weight_map.update(dict.fromkeys(names, dst.name))
        total += src.stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")  # as save_pretrained records its parameters' dtype
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
