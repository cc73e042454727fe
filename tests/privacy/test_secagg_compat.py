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
