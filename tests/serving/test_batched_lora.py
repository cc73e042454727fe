"""StackedLoraLinear: each row gets exactly its own adapters' low-rank terms, weighted."""
import pytest
import torch
from torch import nn

from serving.batched_lora import AdapterBank, RowMix


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5, bias=True)
        self.other = nn.Linear(5, 5, bias=False)


def factors(seed: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"base_model.model.proj.lora_A.weight": torch.randn(rank, 6, generator=g),
            "base_model.model.proj.lora_B.weight": torch.randn(5, rank, generator=g)}


def test_each_row_adds_its_own_weighted_adapters_to_the_base_output():
    torch.manual_seed(0)
    model = Tiny()
    plain = nn.Linear(6, 5)
    plain.load_state_dict(model.proj.state_dict())
    bank = AdapterBank(model)
    a, b = factors(1, 2), factors(2, 3)
    bank.install("a", a, {"rank": 2, "alpha": 4.0, "target_modules": ["proj"]})  # scale 2
    bank.install("b", b, {"rank": 3, "alpha": 3.0, "target_modules": ["proj"]})  # scale 1
    x = torch.randn(4, 7, 6)
    rows = [[("a", 1.0)], [], [("b", 1.0)], [("a", 0.25), ("b", 0.75)]]
    with bank.rows(RowMix.of(rows)):
        y = model.proj(x)

    def delta(f, scale):
        return x @ (f["base_model.model.proj.lora_B.weight"] @ f["base_model.model.proj.lora_A.weight"]).T * scale

    base = plain(x)
    expected = torch.stack([base[0] + delta(a, 2)[0], base[1], base[2] + delta(b, 1)[2],
                            base[3] + 0.25 * delta(a, 2)[3] + 0.75 * delta(b, 1)[3]])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    with bank.rows(None):
        torch.testing.assert_close(model.proj(x), base)
    assert isinstance(model.other, nn.Linear)  # a layer no adapter adapts stays as it was


def test_a_row_of_an_unknown_slot_is_refused():
    bank = AdapterBank(Tiny())
    with pytest.raises(KeyError, match="not installed"):
        with bank.rows(RowMix.of([[("nope", 1.0)]])):
            pass
