"""Named contracts and geometry specs (``core.contracts.get_contract``)."""

import pytest

from flashinfer.moe_ep.core.contracts import CONTRACTS, get_contract, parse_geometry
from flashinfer.moe_ep.errors import MoEEpConfigError


def test_names_resolve_to_the_table() -> None:
    for name, c in CONTRACTS.items():
        assert get_contract(name) is c


@pytest.mark.parametrize(
    ("spec", "fields"),
    [
        ("h2048-i1024-e128-k8", (2048, 1024, 128, 8, "swiglu", None)),
        ("h2688-i1856-e128-k6-relu2", (2688, 1856, 128, 6, "relu2", None)),
        ("h2880-i2880-e128-k4-swiglu_oai-limit7", (2880, 2880, 128, 4, "swiglu_oai", 7.0)),
        ("h2048-i768-e128-k8-limit7.5", (2048, 768, 128, 8, "swiglu", 7.5)),
    ],
)
def test_a_geometry_spec_is_a_contract_named_by_itself(spec: str, fields: tuple) -> None:
    c = get_contract(spec)
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit) == fields
    assert c.name == spec and get_contract(c.name) == c  # tables print the name: it reads back


def test_a_geometry_spec_matches_the_named_contract_it_writes() -> None:
    q = CONTRACTS["qwen3-30b-a3b"]
    c = get_contract("h2048-i768-e128-k8")
    assert c.flops(5) == q.flops(5) and c.weight_bytes_per_expert() == q.weight_bytes_per_expert()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("h2048-i1024-e128", "is not a geometry"),
        ("h2048-i1024-e128-k8-", "is not a geometry"),
        ("h2048-i1024-e8-k9", "exceeds experts"),
        ("h2048-i1024-e128-k8-gelu", "unknown activation 'gelu'"),
        ("h0-i64-e8-k2", "must be >= 1"),
        ("h2048-i1024-e128-k8-relu2-limit7", "takes no clamp limit"),
        ("h2048-i1024-e128-k8-limit0", "finite positive"),
    ],
)
def test_a_bad_geometry_says_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(MoEEpConfigError, match=says):
        get_contract(spec)
    with pytest.raises(MoEEpConfigError, match=says):
        parse_geometry(spec)


def test_an_unknown_name_lists_the_names_and_the_geometry_form() -> None:
    with pytest.raises(MoEEpConfigError) as err:
        get_contract("qwen4")
    assert "qwen3-30b-a3b" in str(err.value) and "h<hidden>-i<intermediate>" in str(err.value)
