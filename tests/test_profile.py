"""05_profile's bookkeeping without timing anything: the bytes bound and the pooled, order-alternating rounds."""
import pytest

from spap_lib import profile as prof


def test_rounds_alternate_the_order_and_pool_every_run(monkeypatch):
    calls = []

    def fake(source, **kwargs):
        calls.append(source)
        t = float(len(calls))  # a machine that slows down steadily: later runs take longer
        return {"seconds_all": [t, t + 0.5], "peak_mem_mb": 100.0 + len(calls), "weights_read": 1}

    monkeypatch.setattr(prof, "profile", fake)
    out = prof.profile_rounds({"dense": "d", "20%": "p"}, rounds=3, repeats=2)
    assert calls == ["d", "p", "p", "d", "d", "p"]  # A B, B A, A B: drift lands on both alike
    assert list(out) == ["dense", "20%"]
    assert out["dense"]["runs"] == 6 and out["dense"]["seconds_all"] == [1, 1.5, 4, 4.5, 5, 5.5]
    assert out["dense"]["seconds_median"] == 4.25 and out["20%"]["seconds_median"] == 3.25
    assert out["20%"]["seconds_min"] == 2 and out["20%"]["seconds_max"] == 6.5
    assert out["dense"]["peak_mem_mb"] == 105.0  # the largest peak over its rounds
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        prof.profile_rounds({"dense": "d"}, rounds=0)


def test_bytes_bound():
    assert prof.bytes_bound(100, 80) == pytest.approx(1.25)
