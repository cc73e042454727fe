import pytest

from privacy.secagg.compat import check_codec
from privacy.secagg.errors import BadSecAggMessage


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4"])
def test_dense_quantizers_compose(spec):
    check_codec(spec)


@pytest.mark.parametrize("spec,kind", [("topk", "sparsifier"), ("randomk+terngrad", "pipeline"),
                                       ("powersgd", "lowrank")])
def test_sparsifying_codecs_are_refused_in_one_line(spec, kind):
    with pytest.raises(BadSecAggMessage) as refused:
        check_codec(spec)
    assert f"the {kind} codec {spec!r}" in refused.value.message and "\n" not in refused.value.message


def test_flatten_follows_the_manifest_and_round_trips():
    import torch

    from privacy.secagg.vector import flatten, unflatten

    manifest = [("a.lora_A", (2, 3)), ("b.lora_B", (4,))]
    delta = {"b.lora_B": torch.tensor([7.0, 8, 9, 10]), "a.lora_A": torch.arange(6.0).reshape(2, 3)}
    flat = flatten(delta, manifest)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    back = unflatten(flat, manifest)
    assert all(torch.equal(back[k], delta[k]) for k in delta)
    with pytest.raises(BadSecAggMessage, match="shape"):
        flatten({"a.lora_A": torch.zeros(3, 2), "b.lora_B": torch.zeros(4)}, manifest)
