"""Active-request tracking: bookings add exact loads and every exit path takes them away again."""

import gc
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamograph.router.active import ActiveRequests, RequestGuard, SlotLoad

pytestmark = pytest.mark.unit

SLOTS = [(1, 0), (1, 1), (2, 0)]


def family_keys(family: int, n: int) -> list[int]:
    """Prefix keys of the first `n` blocks of a prompt of `family` (equal prefixes, equal keys;
    ≥ 2, as `index.chain_keys` makes them)."""
    return [family * 100_000 + i + 2 for i in range(n)]


def summary(load: SlotLoad) -> tuple[int, int, int]:
    return load.prefill_blocks, load.decode_blocks, load.requests


def guard_for(
    active: ActiveRequests,
    n: int,
    disagg: bool,
    prompt: int,
    uncached: int,
    osl,
    keys: list[int] = (),
):
    prefill = None
    if disagg:
        prefill = active.book(
            SLOTS[2], prompt_blocks=prompt, prompt_keys=keys, prefill_blocks=uncached
        )
    decode = active.book(
        SLOTS[n % 2],
        prompt_blocks=prompt,
        prompt_keys=keys,
        prefill_blocks=0 if disagg else uncached,
        expected_output_tokens=osl,
    )
    return RequestGuard(active, f"req-{n}", decode, prefill)


op = st.one_of(
    st.tuples(
        st.just("book"),
        st.booleans(),
        st.integers(0, 64),
        st.integers(0, 64),
        st.none() | st.integers(1, 500),
        st.integers(0, 2),  # prompt family: requests of one family share their prefix keys
        st.integers(0, 64),  # keyed (full) blocks of the prompt
    ),
    st.tuples(st.just("prefill_done"), st.integers(0, 30)),
    st.tuples(st.just("output"), st.integers(0, 30), st.integers(0, 200)),
    st.tuples(st.just("free"), st.integers(0, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),  # an exception inside `with guard`
    st.tuples(st.just("drop"), st.integers(0, 30)),  # the caller loses the guard (GC)
    st.tuples(st.just("remove_slot"), st.sampled_from(SLOTS)),
)


def live_keys(active: ActiveRequests, guards: list[RequestGuard]) -> tuple[dict, dict]:
    """Per slot, the live bookings' distinct prompt keys and the sum of their private blocks.
    (A function, so no loop variable keeps a dropped guard alive.)"""
    keys: dict = {}
    private: dict = {}
    for guard in guards:
        for booking in (guard._decode, guard._prefill):
            if booking is not None and booking.current(active._loads) is not None:
                keys.setdefault(booking.slot, set()).update(booking.keys.tolist())
                private[booking.slot] = private.get(booking.slot, 0) + booking.private
    return keys, private


def live_unanswered(active: ActiveRequests, guards: list[RequestGuard]) -> dict:
    """Per slot, the live bookings whose prefill has not ended (what the stalled filter
    waits on), counted from the bookings themselves."""
    counts: dict = {}
    for guard in guards:
        for booking in (guard._decode, guard._prefill):
            live = booking is not None and booking.current(active._loads) is not None
            if live and not booking.answered:
                counts[booking.slot] = counts.get(booking.slot, 0) + 1
    return counts


def expected_decode(active: ActiveRequests, guards: list[RequestGuard]) -> dict:
    """Decode load per slot recomputed from the live bookings: distinct keys + private blocks."""
    keys, private = live_keys(active, guards)
    return {slot: len(keys[slot]) + private[slot] for slot in keys}


def check_columns_and_held(active: ActiveRequests, guards: list[RequestGuard]) -> None:
    """The scheduler's views agree with the bookings: each slot's row of `sums`, and how much
    of each family's prompt its live requests hold (counted key by key here)."""
    loads = active.loads()
    keys, _ = live_keys(active, guards)
    unanswered = live_unanswered(active, guards)
    for slot in SLOTS:
        load = loads.get(slot)
        row = tuple(active.sums[active.column(slot)].tolist())
        if load is None:
            assert row == (0, 0, 0, 0)
            continue
        assert row == (load.prefill_blocks, load.decode_blocks, load.requests, load.unanswered)
        assert load.unanswered == unanswered.get(slot, 0)
        held = keys.get(slot, set())
        for family in range(3):
            prompt = family_keys(family, 70)
            expected = next((i for i, k in enumerate(prompt) if k not in held), len(prompt))
            assert active.load(slot).held_prefix(prompt) == expected
    by_column = dict(active.held_prefixes(np.array(family_keys(1, 70), np.uint64)))
    for slot in SLOTS:
        held = keys.get(slot, set())
        expected = next((i for i, k in enumerate(family_keys(1, 70)) if k not in held), 70)
        assert by_column.get(active.column(slot), 0) == expected


@settings(max_examples=120, deadline=None)
@given(st.lists(op, max_size=60), st.booleans())
def test_any_lifecycle_ends_with_zero_load(ops, track_output):
    logging.getLogger("dynamograph.router.active").setLevel(logging.ERROR)  # GC warnings expected
    active = ActiveRequests(block_size=16, track_output_blocks=track_output)
    guards: list[RequestGuard] = []
    for step in ops:
        kind = step[0]
        if kind == "book":
            _, disagg, prompt, uncached, osl, family, keyed = step
            keys = family_keys(family, min(keyed, prompt))
            guards.append(
                guard_for(active, len(guards), disagg, prompt, min(uncached, prompt), osl, keys)
            )
        elif not guards:
            continue
        elif kind == "prefill_done":
            guards[step[1] % len(guards)].mark_prefill_done()
        elif kind == "output":
            guards[step[1] % len(guards)].add_output_tokens(step[2])
        elif kind == "free":
            guards[step[1] % len(guards)].free()
        elif kind == "cancel":
            with pytest.raises(RuntimeError), guards[step[1] % len(guards)]:
                raise RuntimeError("client went away")
        elif kind == "drop":  # no cycles: CPython finalises the guard right here
            guards.pop(step[1] % len(guards))
        elif kind == "remove_slot":
            active.drop_slot(step[1])
        # loads never go negative on the way, and each slot's decode load is its live
        # bookings' distinct prompt keys plus their private blocks
        loads = active.loads()
        for load in loads.values():
            assert load.prefill_blocks >= 0 and load.decode_blocks >= 0 and load.requests >= 0
        assert expected_decode(active, guards) == {s: v.decode_blocks for s, v in loads.items()}
        check_columns_and_held(active, guards)
    for guard in guards:
        guard.free()
    guards.clear()
    assert active.loads() == {}
    assert active.total_requests() == 0


def test_book_prefill_done_free_exact_loads():
    active = ActiveRequests()
    guard = guard_for(active, 0, disagg=True, prompt=10, uncached=6, osl=None)
    assert summary(active.load(SLOTS[2])) == (6, 10, 1)
    assert summary(active.load(SLOTS[0])) == (0, 10, 1)
    guard.mark_prefill_done()
    guard.mark_prefill_done()  # idempotent
    assert summary(active.load(SLOTS[2])) == (0, 0, 0)
    assert summary(active.load(SLOTS[0])) == (0, 10, 1)
    assert guard.prefill_done and guard.booked
    guard.free()
    guard.free()  # idempotent
    assert not guard.booked
    assert active.loads() == {}


def test_context_manager_frees_on_error():
    active = ActiveRequests()
    with pytest.raises(ValueError), guard_for(active, 0, False, 8, 8, None):
        assert active.load(SLOTS[0]).requests == 1
        raise ValueError("boom")
    assert active.loads() == {}


def test_collected_guard_frees_and_warns(caplog):
    active = ActiveRequests()
    with caplog.at_level(logging.WARNING, logger="dynamograph.router.active"):
        guard_for(active, 7, disagg=True, prompt=5, uncached=2, osl=None)  # dropped at once
        gc.collect()
    assert "req-7" in caplog.text and "still booked" in caplog.text
    assert active.loads() == {}


@pytest.mark.parametrize("tracked", [False, True])
def test_expected_output_is_booked_then_decays_as_it_is_generated(tracked):
    """agent_hints.osl: its blocks are booked from the start (output tracking or not), and
    weigh by the share of the output still to come."""
    active = ActiveRequests(block_size=16, track_output_blocks=tracked)
    decode = active.book(SLOTS[0], prompt_blocks=4, prefill_blocks=0, expected_output_tokens=320)
    guard = RequestGuard(active, "r", decode)
    assert active.load(SLOTS[0]).decode_blocks == 4 + 20  # 320 expected tokens: 20 blocks
    guard.add_output_tokens(64)  # 80% of the output still to come
    assert active.load(SLOTS[0]).decode_blocks == 4 + 16
    guard.add_output_tokens(256)  # all expected output generated: the request is about to end
    assert active.load(SLOTS[0]).decode_blocks == 4
    guard.free()
    assert active.loads() == {}


def test_output_blocks_without_expected_length_just_grow():
    active = ActiveRequests(block_size=16, track_output_blocks=True)
    guard = RequestGuard(active, "r", active.book(SLOTS[0], prompt_blocks=2, prefill_blocks=2))
    guard.add_output_tokens(17)
    assert active.load(SLOTS[0]).decode_blocks == 2 + 2
    untracked = ActiveRequests(block_size=16)
    g2 = RequestGuard(untracked, "u", untracked.book(SLOTS[0], prompt_blocks=2, prefill_blocks=2))
    g2.add_output_tokens(100)
    assert untracked.load(SLOTS[0]).decode_blocks == 2


def test_freeing_a_booking_of_a_dropped_slot_leaves_the_slot_reborn_alone():
    """A worker leaves and comes back (same slot): old guards must not touch the new sums."""
    active = ActiveRequests()
    old = RequestGuard(active, "old", active.book(SLOTS[0], prompt_blocks=3, prefill_blocks=3))
    active.drop_slot(SLOTS[0])
    new = RequestGuard(active, "new", active.book(SLOTS[0], prompt_blocks=5, prefill_blocks=1))
    old.mark_prefill_done()
    old.add_output_tokens(100)
    old.free()
    assert summary(active.load(SLOTS[0])) == (1, 5, 1)
    new.free()
    assert active.loads() == {}


def test_shared_prompt_blocks_count_once_per_slot():
    """Dynamo's unique-block load: ten requests on one system prompt hold one copy of it."""
    active = ActiveRequests()
    system = family_keys(1, 8)
    a = active.book(SLOTS[0], prompt_blocks=11, prompt_keys=[*system, 901, 902], prefill_blocks=3)
    b = active.book(SLOTS[0], prompt_blocks=10, prompt_keys=[*system, 903], prefill_blocks=1)
    load = active.load(SLOTS[0])
    # 8 shared + 2 + 1 keyed blocks, plus each prompt's partial last block
    assert summary(load) == (4, 8 + 2 + 1 + 1 + 1, 2)
    assert load.held_prefix([*system, 901, 999]) == 9
    assert load.held_prefix([*system[:3], 777]) == 3
    assert load.held_prefix(family_keys(2, 8)) == 0
    assert load.held_prefix([]) == 0
    active.free(a)
    assert summary(active.load(SLOTS[0])) == (1, 8 + 1 + 1, 1)
    assert active.load(SLOTS[0]).held_prefix([*system, 901]) == 8
    active.free(b)
    assert active.loads() == {}


def test_more_keys_than_prompt_blocks_is_refused():
    with pytest.raises(ValueError, match="more prompt keys"):
        ActiveRequests().book(SLOTS[0], prompt_blocks=1, prompt_keys=[1, 2], prefill_blocks=0)


def test_a_slots_key_table_grows_and_keeps_counting():
    """Thousands of distinct prompt keys on one slot (past the table's first size, and through
    its tombstones as bookings leave): loads and held prefixes stay exact."""
    active = ActiveRequests()
    bookings = [
        active.book(SLOTS[0], prompt_blocks=600, prompt_keys=family_keys(f, 600), prefill_blocks=0)
        for f in range(1, 9)
    ]
    assert summary(active.load(SLOTS[0])) == (0, 8 * 600, 8)
    assert active.load(SLOTS[0]).held_prefix(family_keys(5, 700)) == 600
    for b in bookings[:6]:
        active.free(b)
    again = active.book(
        SLOTS[0], prompt_blocks=650, prompt_keys=family_keys(8, 650), prefill_blocks=0
    )
    assert summary(active.load(SLOTS[0])) == (0, 600 + 650, 3)
    assert active.load(SLOTS[0]).held_prefix(family_keys(3, 10)) == 0
    for b in [*bookings[6:], again]:
        active.free(b)
    assert active.loads() == {}
