"""Registry and config validation: names, keys, values, every codec on edge sizes."""
import pytest
import torch

from compression import CODECS, Codec, CompressionError, PayloadError, Pipeline, make_codec

ALL_SPECS = sorted(CODECS) + ["topk+int8", "topk+int4", "randomk+fp16", "threshold+qsgd", "topk+natural"]


def test_registry_holds_every_codec():
    assert set(CODECS) == {
        "none", "fp16", "bf16", "int8", "int4", "qsgd", "natural", "terngrad", "signsgd",
        "topk", "randomk", "threshold", "powersgd",
    }
    assert all(issubclass(cls, Codec) and CODECS[cls.name] is cls for cls in CODECS.values())


def test_unknown_codec_lists_the_valid_names():
    with pytest.raises(CompressionError) as info:
        make_codec("gzip")
    assert "unknown codec 'gzip'" in str(info.value)
    assert all(name in str(info.value) for name in CODECS)
    assert isinstance(info.value, ValueError) and info.value.code == "compression_error"


def test_unknown_codec_inside_a_pipeline():
    with pytest.raises(CompressionError, match="unknown codec 'int3'; valid codecs: bf16, fp16"):
        make_codec("topk+int3")


def test_unknown_config_key_names_the_key_and_the_valid_keys():
    with pytest.raises(CompressionError, match=r"unknown config key 'ration' .*'topk'.*\['ratio', 'chunk_size', 'index_coding'\]"):
        make_codec("topk", {"ration": 0.1})
    with pytest.raises(CompressionError, match="config key 'ration' belongs to no stage in pipeline 'topk\\+int8'"):
        make_codec("topk+int8", {"ration": 0.1})
    with pytest.raises(CompressionError, match="valid keys: none"):
        make_codec("signsgd", {"scale": 1})


@pytest.mark.parametrize(
    "spec, config, message",
    [
        ("topk", {"ratio": 1.5}, r"ratio must be in \(0, 1\], got 1.5"),
        ("topk", {"ratio": 0}, r"ratio must be in \(0, 1\], got 0"),
        ("randomk", {"ratio": "0.1"}, r"ratio must be a finite number in \(0, 1\], got '0.1'"),
        ("qsgd", {"levels": 0}, r"levels must be \[1, 127\], got 0"),
        ("natural", {"bits": 9}, r"bits must be \[2, 8\], got 9"),
        ("threshold", {"threshold": -1.0}, r"threshold must be in \(0, .*got -1.0"),
        ("powersgd", {"rank": 2.5}, r"rank must be an integer, got 2.5"),
        ("int8", {"stochastic": "yes"}, r"stochastic must be true or false, got 'yes'"),
        ("topk", {"index_coding": "gamma"}, r"index_coding must be one of \['rice', 'varint'\], got 'gamma'"),
    ],
)
def test_bad_config_values_are_quoted(spec, config, message):
    with pytest.raises(CompressionError, match=message):
        make_codec(spec, config)


def test_configs_are_frozen():
    codec = make_codec("topk")
    with pytest.raises(AttributeError):
        codec.config.ratio = 0.5


def test_pipeline_takes_flat_or_per_stage_config():
    flat = make_codec("topk+int8", {"ratio": 0.05, "block_size": 32})
    nested = make_codec("topk+int8", {"topk": {"ratio": 0.05}, "int8": {"block_size": 32}})
    assert flat.sparsifier.config == nested.sparsifier.config and flat.sparsifier.config.ratio == 0.05
    assert flat.quantizer.config == nested.quantizer.config and flat.quantizer.config.block_size == 32


def test_pipeline_is_a_composition_not_a_new_codec():
    codec = make_codec("randomk+fp16", {"randomk": {"ratio": 0.5}})
    assert isinstance(codec, Pipeline)
    assert codec.sparsifier.config.ratio == 0.5 and codec.quantizer.name == "fp16"
    assert "randomk+fp16" not in CODECS


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("numel", [0, 1, 63, 1000])
def test_every_codec_round_trips_edge_sizes(spec, numel):
    codec = make_codec(spec)
    x = torch.linspace(-1, 1, numel)
    out = codec.decode(codec.encode(x, seed=3), numel)
    assert out.shape == (numel,) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_codec_maps_zeros_to_zeros(spec):
    codec = make_codec(spec)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(300)), 300), torch.zeros(300))


def test_error_tree():
    assert issubclass(PayloadError, CompressionError) and issubclass(CompressionError, ValueError)
    assert PayloadError.code == "bad_payload"
