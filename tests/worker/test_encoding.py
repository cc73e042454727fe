"""The worker's update encoder: raw, compressed, with error feedback, and its per-sync metrics."""
import pytest
import torch

from compression import decode_update, make_codec
from protocol.schemas import RAW_CODEC
from protocol.tensors import loads, manifest_of
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder


def delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"m.lora_A.weight": torch.randn(4, 64, generator=g), "m.lora_B.weight": torch.randn(32, 4, generator=g)}


LOSSLESS = CompressionSettings(RAW_CODEC)


def test_the_default_push_is_int8_with_error_feedback_and_the_default_pull_an_int8_diff():
    assert CompressionSettings() == CompressionSettings("int8", {}, error_feedback=True)
    assert PullSettings().codec == "int8" and PullSettings().full_every == 10
    encoder = UpdateEncoder(CompressionSettings())
    d = delta(2)
    out = encoder.encode(d, manifest_of(d), seed=0)
    # block 64 with a float32 scale: 8 + 32/64 bits a value, plus the payload's framing
    assert out.codec_meta == {"codec": "int8", "codec_config": {}} and 3.5 < out.metrics["ratio"] < 3.8
    assert 0 < out.metrics["relative_error"] < 0.01 and encoder.residual_norm() > 0  # what int8 rounded off waits


def test_raw_safetensors_is_exact_and_counts_bytes():
    d = delta(0)
    out = UpdateEncoder(LOSSLESS).encode(d, manifest_of(d), seed=0)
    assert all(torch.equal(loads(out.body)[k], d[k]) for k in d)
    m = out.metrics
    assert m["bytes_raw"] == 4 * (4 * 64 + 32 * 4) and m["bytes_sent"] == len(out.body)
    assert m["relative_error"] == 0 and m["residual_norm"] == 0 and m["decode_ms"] >= 0


def test_a_raw_updates_metrics_are_what_measure_finds_without_its_float64_pass():
    from compression import measure

    d = delta(3)
    d["m.lora_B.weight"][:8] = 0  # density counts the zeros
    out = UpdateEncoder(LOSSLESS).encode(d, manifest_of(d), seed=0)
    full = measure(d, loads(out.body), out.body, out.metrics["encode_ms"], out.metrics["decode_ms"])
    fast = {k: v for k, v in out.metrics.items() if k != "residual_norm"}
    assert fast.keys() == full.keys()
    assert all(fast[k] == pytest.approx(full[k], abs=1e-12) for k in full if full[k] is not None)
    assert fast["density"] == pytest.approx(1 - 8 * 4 / (4 * 64 + 32 * 4))


def test_error_feedback_sends_over_time_what_one_sync_drops():
    encoder = UpdateEncoder(CompressionSettings("topk", {"ratio": 0.05}))
    codec = make_codec("topk", {"ratio": 0.05})
    deltas = [delta(i) for i in range(6)]
    manifest = manifest_of(deltas[0])
    sent_total = {k: torch.zeros_like(v) for k, v in deltas[0].items()}
    for i, d in enumerate(deltas):
        out = encoder.encode(d, manifest, seed=i)
        decoded = decode_update(out.body, manifest, codec)
        assert all(torch.equal(decoded[k], out.sent[k]) for k in d)  # sent == what the coordinator decodes
        sent_total = {k: sent_total[k] + decoded[k] for k in d}
        assert out.metrics["ratio"] > 5 and out.metrics["residual_norm"] > 0
    residual = encoder.state_dict()
    meant = {k: sum(d[k] for d in deltas) for k in deltas[0]}
    assert all(torch.allclose(sent_total[k] + residual[k], meant[k], atol=1e-4) for k in meant)


def test_without_error_feedback_nothing_is_carried():
    encoder = UpdateEncoder(CompressionSettings("int8", error_feedback=False))
    d = delta(1)
    out = encoder.encode(d, manifest_of(d), seed=0)
    assert encoder.state_dict() == {} and out.metrics["residual_norm"] == 0 and 3.5 < out.metrics["ratio"] < 4.1


@pytest.mark.parametrize("kwargs, message", [
    ({"codec": "zip"}, "valid codecs"),
    ({"codec": "topk", "config": {"ratio": 2}}, "ratio"),
])
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressionSettings(**kwargs)


def test_pull_settings_validate():
    with pytest.raises(ValueError, match="full-pull-every"):
        PullSettings(codec="fp16", full_every=0)
    with pytest.raises(ValueError, match="valid codecs"):
        PullSettings(codec="nope")


def test_a_flush_sends_the_delta_plus_the_residual_exactly_and_carries_nothing_on():
    encoder = UpdateEncoder(CompressionSettings("topk+int8", {"ratio": 0.05}))
    deltas = [delta(i) for i in range(4)]
    manifest = manifest_of(deltas[0])
    sent = [encoder.encode(d, manifest, seed=i).sent for i, d in enumerate(deltas[:3])]
    residual = encoder.state_dict()
    assert encoder.residual_norm() > 1  # topk 5% left most of three deltas behind

    out = encoder.encode(deltas[3], manifest, seed=3, flush=True)
    assert out.codec_meta == {"codec": "safetensors", "codec_config": {}}  # what the coordinator is told
    flushed = loads(out.body)
    assert all(torch.equal(flushed[k], deltas[3][k] + residual[k]) for k in flushed)
    assert out.metrics["relative_error"] == 0 and out.metrics["residual_norm"] == 0 and encoder.state_dict() == {}
    assert out.metrics["flushed_residual_norm"] == pytest.approx(
        float(torch.cat([r.reshape(-1) for r in residual.values()]).norm()), rel=1e-5)
    total = {k: sum(s[k] for s in sent) + flushed[k] for k in flushed}  # everything the coordinator decoded
    assert all(torch.allclose(total[k], sum(d[k] for d in deltas), atol=1e-5) for k in total)


def test_an_ordinary_update_keeps_its_codec_in_the_metadata():
    encoder = UpdateEncoder(CompressionSettings("topk+int8", {"ratio": 0.05}))
    out = encoder.encode(delta(0), manifest_of(delta(0)), seed=0)
    assert out.codec_meta == {"codec": "topk+int8", "codec_config": {"ratio": 0.05}}


def test_a_residual_from_a_checkpoint_of_another_codec_goes_into_the_next_update():
    residual = {k: torch.full_like(v, 0.5) for k, v in delta(0).items()}
    encoder = UpdateEncoder(LOSSLESS)  # resumed without a lossy codec: nothing to carry it in
    encoder.load_state_dict(residual)
    assert encoder.residual_norm() > 0
    d = delta(1)
    out = encoder.encode(d, manifest_of(d), seed=0)
    assert all(torch.equal(loads(out.body)[k], d[k] + 0.5) for k in d) and encoder.state_dict() == {}
    with pytest.raises(ValueError, match="NaN"):
        encoder.load_state_dict({"x": torch.tensor([float("nan")])})
