"""The `up --bench` workload: prefix structure and the numbers computed from engine metrics."""

import pytest

from dynamograph.local.load import PassResult, Workload, _delta_ratio, prompts, results_table
from dynamograph.local.status import EngineSample

pytestmark = pytest.mark.unit


def test_every_group_shares_one_long_prefix_and_requests_differ():
    w = Workload(groups=3, per_group=4, prefix_words=50, suffix_words=5)
    sent = prompts(w, seed=7)
    assert len(sent) == 12
    for g in range(3):
        texts = [p for group, p in sent if group == g]
        assert len(texts) == 4 and len(set(texts)) == 4
        prefix = texts[0].split("\n")[0]
        assert all(t.startswith(prefix + "\n") for t in texts)
        assert len(prefix.split()) == 51  # the marker plus 50 words
    prefixes = {p.split("\n")[0] for _, p in sent}
    assert len(prefixes) == 3


def test_order_is_shuffled_and_seeds_give_fresh_prefixes():
    w = Workload(groups=4, per_group=4, prefix_words=20)
    order = [g for g, _ in prompts(w, seed=1)]
    assert order != sorted(order) and order != [i % 4 for i in range(16)]
    a = {p.split("\n")[0] for _, p in prompts(w, seed=1)}
    b = {p.split("\n")[0] for _, p in prompts(w, seed=2)}
    assert not a & b  # the second pass never finds the first one's prefixes cached


def test_hit_rate_and_engine_ttft_are_deltas_over_the_pass():
    before = {"a": EngineSample(prefix_queries=100, prefix_hits=10, ttft_sum=1.0, ttft_count=4)}
    after = {
        "a": EngineSample(prefix_queries=300, prefix_hits=160, ttft_sum=1.5, ttft_count=9),
        "gone": None,
    }
    assert _delta_ratio(before, after, "prefix_hits", "prefix_queries") == pytest.approx(0.75)
    assert _delta_ratio(before, after, "ttft_sum", "ttft_count") == pytest.approx(0.1)
    assert _delta_ratio(before, before, "prefix_hits", "prefix_queries") is None


def test_results_table_has_a_row_per_pass():
    result = PassResult("kv", 10, 1, 0.5, 12.0, [10.0, 20.0, 30.0], 1.25)
    table = results_table([result, result])
    assert table.row_count == 2
    cells = [column._cells[0] for column in table.columns]
    assert cells[:4] == ["kv", "9/10", "50.0%", "12.0"] and cells[-1] == "1.25"
