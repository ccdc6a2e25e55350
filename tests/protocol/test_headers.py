"""Routing headers: every case of the seed's nvext.rs tests plus invalid, alias and sentinel cases."""

import pytest
from multidict import CIMultiDict

from dynamograph.protocol.headers import (
    ALIASES,
    DP_RANK,
    PREFILL_DP_RANK,
    PREFILL_INSTANCE_ID,
    WORKER_INSTANCE_ID,
    RoutingHeaderError,
    apply_header_routing_overrides,
    is_spoofable,
    parse_routing_headers,
    routing_header_values,
)
from dynamograph.protocol.nvext import NvExt

pytestmark = pytest.mark.unit


def test_seed_all_four_headers_on_no_nvext():
    headers = {
        WORKER_INSTANCE_ID: "123",
        PREFILL_INSTANCE_ID: "456",
        DP_RANK: "3",
        PREFILL_DP_RANK: "5",
    }
    result = apply_header_routing_overrides(None, headers)
    assert result.backend_instance_id == 123
    assert result.decode_worker_id == 123
    assert result.prefill_worker_id == 456
    assert result.dp_rank == 3
    assert result.prefill_dp_rank == 5


def test_no_headers_returns_nvext_unchanged():
    assert apply_header_routing_overrides(None, {}) is None
    original = NvExt(backend_instance_id=7, extra_fields=["timing"])
    assert apply_header_routing_overrides(original, {"content-type": "json"}) is original


def test_headers_win_over_body_and_keep_other_fields():
    body = NvExt(backend_instance_id=1, decode_worker_id=1, dp_rank=9, extra_fields=["worker_id"])
    result = apply_header_routing_overrides(body, {WORKER_INSTANCE_ID: "2"})
    assert (result.backend_instance_id, result.decode_worker_id) == (2, 2)
    assert result.dp_rank == 9  # untouched: no x-dp-rank header
    assert result.extra_fields == ["worker_id"]
    assert body.backend_instance_id == 1  # the input is not mutated


@pytest.mark.parametrize(
    "value", ["abc", "-1", "1.5", "", " ", "0x10", "18446744073709551616", "١٢", "1 2"]
)
def test_unparsable_worker_id_is_ignored(value):
    assert apply_header_routing_overrides(None, {WORKER_INSTANCE_ID: value}) is None


def test_u64_max_is_accepted_and_u32_limit_applies_to_ranks():
    routing = parse_routing_headers({WORKER_INSTANCE_ID: str((1 << 64) - 1), DP_RANK: str(1 << 32)})
    assert routing.worker_id == (1 << 64) - 1
    assert routing.dp_rank is None


def test_plus_sign_parses_like_rust():
    assert parse_routing_headers({DP_RANK: "+4"}).dp_rank == 4


def test_prefill_dp_rank_sentinel_means_unset():
    assert apply_header_routing_overrides(None, {PREFILL_DP_RANK: "4294967295"}) is None
    result = apply_header_routing_overrides(
        None, {PREFILL_INSTANCE_ID: "8", PREFILL_DP_RANK: "4294967295"}
    )
    assert result.prefill_worker_id == 8
    assert result.prefill_dp_rank is None


def test_decode_dp_rank_has_no_sentinel():
    assert parse_routing_headers({DP_RANK: "4294967295"}).dp_rank == 4294967295


def test_aliases_are_accepted():
    headers = {alias: "11" for alias in ALIASES.values()}
    routing = parse_routing_headers(headers)
    assert routing.worker_id == routing.prefill_worker_id == routing.dp_rank == 11


def test_plain_name_wins_over_alias_and_alias_fills_in_when_plain_is_bad():
    assert (
        parse_routing_headers({WORKER_INSTANCE_ID: "1", ALIASES[WORKER_INSTANCE_ID]: "2"}).worker_id
        == 1
    )
    assert (
        parse_routing_headers(
            {WORKER_INSTANCE_ID: "junk", ALIASES[WORKER_INSTANCE_ID]: "2"}
        ).worker_id
        == 2
    )


def test_header_names_are_case_insensitive():
    assert parse_routing_headers({"X-Worker-Instance-Id": "5"}).worker_id == 5
    assert parse_routing_headers(CIMultiDict({"X-DP-RANK": "2"})).dp_rank == 2


def test_strict_parsing_names_header_and_value():
    with pytest.raises(
        RoutingHeaderError, match=r"header x-dp-rank: 'minus-one' is not an unsigned"
    ):
        parse_routing_headers({DP_RANK: "minus-one"}, strict=True)


def test_emitted_headers_round_trip():
    values = routing_header_values(42, 1, prefill_worker_id=43, prefill_dp_rank=0)
    routing = parse_routing_headers(values)
    assert (
        routing.worker_id,
        routing.dp_rank,
        routing.prefill_worker_id,
        routing.prefill_dp_rank,
    ) == (
        42,
        1,
        43,
        0,
    )
    assert set(routing_header_values(42)) == {WORKER_INSTANCE_ID}


@pytest.mark.parametrize(
    ("name", "spoofable"),
    [
        ("X-Worker-Instance-Id", True),
        ("x-dynamo-dp-rank", True),
        ("x-gateway-destination-endpoint", True),
        ("x-gateway-anything", True),
        ("X-Gateway-Inference-Objective", False),  # GAIE has the client name its objective
        ("content-type", False),
        ("x-request-id", False),
    ],
)
def test_spoofable_headers(name, spoofable):
    assert is_spoofable(name) is spoofable
