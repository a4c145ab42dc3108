"""Zero-shot evaluation: the request cache that lets an interrupted whole-split run resume, keyed by the weights."""
import pytest
import torch

import spap_lib as sl
from spap_lib.evaluation import zeroshot


def test_fingerprint_names_the_weights_not_the_object():
    from conftest import tiny_model

    a, b = tiny_model("llama"), tiny_model("llama")
    assert zeroshot.fingerprint(a) == zeroshot.fingerprint(b)  # same weights, another object
    with torch.no_grad():
        b.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # a refit changes values (index 0 is always sampled)
    assert zeroshot.fingerprint(a) != zeroshot.fingerprint(b)
    adapter = sl.get_adapter(a)
    adapter.keep_channels([list(range(8))] * len(adapter.layers()))  # pruning changes shapes
    assert zeroshot.fingerprint(a) != zeroshot.fingerprint(tiny_model("llama"))


@pytest.mark.slow
def test_an_interrupted_evaluation_resumes_from_the_request_cache(tmp_path, monkeypatch):
    """The first run scores 2 RTE examples (4 requests) and stops; the rerun over 4 examples sends only the
    4 requests it has not answered to the model, and gives the numbers an uncached run gives."""
    from lm_eval.models.huggingface import HFLM

    if not (sl.data_dir() / "rte").is_dir():
        pytest.skip("RTE not in SPAP_DATA_DIR")
    loaded = sl.load("smollm2-135m", device="cpu")
    sent = []
    real = HFLM.loglikelihood
    monkeypatch.setattr(HFLM, "loglikelihood",
                        lambda self, requests, **k: sent.append(len(requests)) or real(self, requests, **k))
    args = (loaded.model, loaded.tokenizer, ["rte"])
    zeroshot.evaluate(*args, limit=2, cache_dir=tmp_path)
    resumed = zeroshot.evaluate(*args, limit=4, cache_dir=tmp_path)
    uncached = zeroshot.evaluate(*args, limit=4)
    assert sent == [4, 4, 8]  # 2 choices per example: 2 examples, then only the 2 new ones, then all 4 uncached
    assert resumed == uncached
    assert [p.name for p in tmp_path.iterdir()] == [f"{zeroshot.fingerprint(loaded.model)}_rank0.db"]
