"""`dynamograph up` end to end: real Envoy, EPP, frontends and mock engines as local processes.

Each graph is started the way a user (or a script) starts it, `dynamograph up --detach`, and
stopped with `dynamograph down`; clients are the official `openai` package pointed at Envoy.
"""

import os
import uuid

import openai
import pytest

from dynamograph.local.envoy import BUNDLED_ENVOY, find_envoy

from .conftest import (
    Detached,
    assert_all_gone,
    dynamograph,
    engine_ids,
    engines,
    require_envoy,
    served_counts,
)

pytestmark = pytest.mark.e2e


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


NVEXT = {"nvext": {"extra_fields": ["worker_id"]}}


def nvext_of(obj) -> dict:
    return (obj.model_extra or {}).get("nvext") or {}


def stream_nvext(chunks) -> tuple[str, dict]:
    text, nvext = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else (choice.text or "")
        nvext = nvext_of(chunk) or nvext
    return text, nvext


def test_up_detach_prints_the_base_url_and_records_every_process(agg_stack):
    """`dynamograph up --detach` with no graph runs the bundled examples/agg.yaml."""
    assert agg_stack.base_url in agg_stack.stdout
    kinds = [p["spec"]["kind"] for p in agg_stack.state["processes"]]
    assert kinds.count("engine") == 4 and kinds.count("frontend") == 4
    assert "epp" in kinds and "envoy" in kinds
    # The real Envoy that `make setup` installs into .local/envoy (unless overridden).
    envoy = next(p for p in agg_stack.state["processes"] if p["spec"]["kind"] == "envoy")
    assert envoy["spec"]["argv"][0] == str(find_envoy())
    if not os.environ.get("DYNAMOGRAPH_ENVOY") and BUNDLED_ENVOY.is_file():
        assert envoy["spec"]["argv"][0] == str(BUNDLED_ENVOY)
    models = client(agg_stack.base_url).models.list()
    assert [m.id for m in models.data] == ["qwen"]


def test_chat_and_completion_streaming_and_not_through_envoy(agg_stack):
    ids = engine_ids(agg_stack.state)
    c = client(agg_stack.base_url)
    messages = [{"role": "user", "content": "Hello there"}]

    chat = c.chat.completions.create(
        model="qwen", messages=messages, max_tokens=8, extra_body=NVEXT
    )
    assert chat.choices[0].message.content
    assert int(nvext_of(chat)["worker_id"]["decode_worker_id"]) in ids

    text, nvext = stream_nvext(
        c.chat.completions.create(
            model="qwen", messages=messages, max_tokens=8, stream=True, extra_body=NVEXT
        )
    )
    assert text and int(nvext["worker_id"]["decode_worker_id"]) in ids

    completion = c.completions.create(
        model="qwen", prompt="Once upon a time", max_tokens=8, extra_body=NVEXT
    )
    assert completion.choices[0].text
    assert int(nvext_of(completion)["worker_id"]["decode_worker_id"]) in ids

    text, nvext = stream_nvext(
        c.completions.create(
            model="qwen", prompt="Once upon a time", max_tokens=8, stream=True, extra_body=NVEXT
        )
    )
    assert text and int(nvext["worker_id"]["decode_worker_id"]) in ids


def test_unknown_model_is_a_clear_404(agg_stack):
    with pytest.raises(openai.NotFoundError):
        client(agg_stack.base_url).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_shared_prefix_requests_land_on_one_worker_that_says_so(agg_stack):
    """KV routing keeps a prefix on the worker that caches it; nvext.worker_id names that
    worker, and the engines' own counters agree on who served the requests."""
    ids = engine_ids(agg_stack.state)
    before = served_counts(agg_stack.state)
    c = client(agg_stack.base_url)
    prefix = f"[{uuid.uuid4()}] " + "You are a careful assistant for routing tests. " * 40
    chosen, cached = [], []
    for i in range(6):
        chat = c.chat.completions.create(
            model="qwen",
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"Q{i}"}],
            max_tokens=4,
            extra_body=NVEXT,
        )
        chosen.append(int(nvext_of(chat)["worker_id"]["decode_worker_id"]))
        details = chat.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert len(set(chosen)) == 1, f"shared prefix spread over {[ids[w] for w in chosen]}"
    worker = ids[chosen[0]]
    assert all(n > 0 for n in cached[1:]), cached  # the later requests hit the cached prefix
    after = served_counts(agg_stack.state)
    delta = {name: after[name] - before[name] for name in after}
    assert delta[worker] == 6, delta
    assert sum(delta.values()) == 6, delta


def test_status_shows_every_worker(agg_stack):
    result = dynamograph("up", str(agg_stack.path), "--status", state_dir=agg_stack.state_dir)
    for p in engines(agg_stack.state):
        assert p["spec"]["name"] in result.stdout
    assert agg_stack.base_url in result.stdout


def test_up_refuses_a_second_copy_of_a_running_graph(agg_stack):
    result = dynamograph("up", str(agg_stack.path), state_dir=agg_stack.state_dir, check=False)
    assert result.returncode == 1 and "already running" in result.stderr


def test_bench_compares_kv_routing_with_round_robin(agg_stack):
    result = dynamograph("up", str(agg_stack.path), "--bench", state_dir=agg_stack.state_dir)
    rows = [line for line in result.stdout.splitlines() if "64/64" in line]
    assert len(rows) == 2, result.stdout  # both passes, every request answered
    assert "kv (Envoy + EPP)" in rows[0] and "round-robin" in rows[1]
    assert all("%" in row for row in rows)  # hit rates measured on the engines


def test_down_stops_everything_and_frees_the_ports(agg_stack):
    state = agg_stack.state
    result = agg_stack.down()
    assert result.returncode == 0, result.stderr
    assert "stopped" in result.stdout
    assert_all_gone(state)
    again = dynamograph("down", "agg", state_dir=agg_stack.state_dir, check=False)
    assert again.returncode == 1 and "not running" in again.stderr


def test_disaggregated_example_served_end_to_end_through_envoy(tmp_path):
    require_envoy()
    with Detached("disagg", tmp_path) as stack:
        state = stack.state
        ids = engine_ids(state)
        roles = {p["spec"]["name"]: p["spec"]["role"] for p in engines(state)}
        before = served_counts(state)
        c = client(stack.base_url)
        messages = [{"role": "user", "content": "Explain disaggregated serving briefly."}]
        chat = c.chat.completions.create(
            model="qwen", messages=messages, max_tokens=8, extra_body=NVEXT
        )
        assert chat.choices[0].message.content
        picked = nvext_of(chat)["worker_id"]
        assert roles[ids[int(picked["prefill_worker_id"])]] == "prefill"
        assert roles[ids[int(picked["decode_worker_id"])]] == "decode"

        text, nvext = stream_nvext(
            c.chat.completions.create(
                model="qwen", messages=messages, max_tokens=8, stream=True, extra_body=NVEXT
            )
        )
        assert text
        assert roles[ids[int(nvext["worker_id"]["prefill_worker_id"])]] == "prefill"
        # Both legs really ran, on the engines nvext names (worker side).
        after = served_counts(state)
        for name, role in roles.items():
            if name in (
                ids[int(picked["prefill_worker_id"])],
                ids[int(picked["decode_worker_id"])],
            ):
                assert after[name] > before[name], (name, role)
        assert sum(after[n] - before[n] for n in roles if roles[n] == "prefill") == 2
        assert sum(after[n] - before[n] for n in roles if roles[n] == "decode") == 2
        # The decode engine pulled the prefill's KV (with the graph's admin token, which
        # `up` hands every engine): a new long prompt is cached on arrival, not recomputed.
        long = [{"role": "user", "content": "Pull the KV of this prompt, please. " * 20}]
        pulled = c.chat.completions.create(model="qwen", messages=long, max_tokens=2)
        assert pulled.usage.prompt_tokens_details.cached_tokens >= 128, pulled.usage
        result = stack.down()
        assert result.returncode == 0, result.stderr
    assert_all_gone(state)
