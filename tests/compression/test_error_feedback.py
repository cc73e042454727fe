"""Error feedback: nothing is lost (decay 1), state survives a safetensors round trip."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from compression import CompressionError, ErrorFeedback, decode_update, make_codec

MANIFEST = [("a", (8, 96)), ("b", (96, 8))]


def deltas(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) for name, shape in MANIFEST}


@pytest.mark.parametrize("spec", ["topk", "topk+int4", "signsgd", "randomk+fp16", "qsgd", "powersgd"])
def test_sent_plus_residual_equals_everything_meant_to_be_sent(spec):
    ef = ErrorFeedback(make_codec(spec))
    meant = {name: torch.zeros(shape) for name, shape in MANIFEST}
    sent_total = {name: torch.zeros(shape) for name, shape in MANIFEST}
    for step in range(6):
        update = deltas(step)
        out = ef.compress(update, MANIFEST, seed=step)
        payload, sent = out.payload, out.decoded
        assert all(torch.equal(sent[n], t) for n, t in decode_update(payload, MANIFEST, ef.codec).items())
        for name in meant:
            meant[name] += update[name]
            sent_total[name] += sent[name]
    residual = ef.state_dict()
    for name in meant:
        assert torch.allclose(sent_total[name] + residual[name], meant[name], atol=1e-5)
        assert residual[name].abs().sum() > 0  # the codec did drop something


def test_residual_is_fed_into_the_next_sync():
    ef = ErrorFeedback(make_codec("topk", {"ratio": 0.1}))
    first = deltas(0)
    sent = ef.compress(first, MANIFEST).decoded
    sent_again = ef.compress({n: torch.zeros_like(t) for n, t in first.items()}, MANIFEST).decoded
    # with a zero delta, the second sync transmits the largest leftovers of the first
    leftover = first["a"] - sent["a"]
    picked = sent_again["a"] != 0
    assert picked.any() and torch.equal(sent_again["a"][picked], leftover[picked])


def test_decay_scales_the_residual():
    update = deltas(0)
    ef = ErrorFeedback(make_codec("signsgd"), decay=0.5)
    sent = ef.compress(update, MANIFEST).decoded
    assert torch.allclose(ef.state_dict()["a"], 0.5 * (update["a"] - sent["a"]))
    ef0 = ErrorFeedback(make_codec("signsgd"), decay=0.0)
    ef0.compress(update, MANIFEST)
    assert all(torch.count_nonzero(r) == 0 for r in ef0.state_dict().values())


def test_state_survives_safetensors_and_resumes_identically(tmp_path):
    codec = make_codec("topk+int8", {"topk": {"ratio": 0.05}})
    ef = ErrorFeedback(codec)
    for step in range(3):
        ef.compress(deltas(step), MANIFEST, seed=step)
    save_file(ef.state_dict(), tmp_path / "residual.safetensors")
    resumed = ErrorFeedback(codec)
    resumed.load_state_dict(load_file(tmp_path / "residual.safetensors"))
    assert resumed.compress(deltas(3), MANIFEST, seed=3).payload == ef.compress(deltas(3), MANIFEST, seed=3).payload


def test_misuse_is_reported():
    with pytest.raises(CompressionError, match=r"decay must be in \[0, 1\], got 1.5"):
        ErrorFeedback(make_codec("topk"), decay=1.5)
    ef = ErrorFeedback(make_codec("topk"))
    with pytest.raises(CompressionError, match="missing"):
        ef.compress({"a": torch.zeros(8, 96)}, MANIFEST)
    ef.load_state_dict({"a": torch.zeros(3), "b": torch.zeros(96, 8)})
    with pytest.raises(CompressionError, match="residual for 'a' has shape"):
        ef.compress(deltas(0), MANIFEST)
    with pytest.raises(CompressionError, match="NaN"):
        ef.load_state_dict({"a": torch.full((8, 96), float("nan"))})
