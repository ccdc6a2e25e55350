"""The router core's public face: workers in, KV events in, `schedule(RouteRequest) -> Decision` out.

Dynamo's KV router, in process (seeds: kv_push_router.rs, the prefill router, sticky
sessions). The `Router` owns the KV index (`index.KvIndex`), the active-request books
(`active.ActiveRequests`) and the worker table; selection itself is the routing profile
(`profile.Profile`: filters → scorers → picker, named in `RouterConfig`). Pure in-process
logic: no I/O, no clocks except the injected one, so the EPP and the frontend's `kv` mode drive
it the same way (through `pipeline.RequestPipeline`):

    router = Router(RouterConfig(...))
    router.add_worker(wid, role=Role.AGGREGATED, dp_size=1, block_size=16, total_blocks=8192)
    gap = router.apply_kv_batch(wid, seq, batch)          # from the ZMQ subscriber
    router.update_load(wid, 0, waiting=2, running=5, kv_usage=0.4)   # from /metrics
    decision = router.schedule(RouteRequest(request_id, block_hashes, isl_tokens))
    with decision.guard:                                  # None for query-only requests
        ... first token → decision.guard.mark_prefill_done() ...

Refusals are exceptions carrying the HTTP status a caller should answer with (`errors`):
`NoEligibleWorker` (503, with the reason) and `Overloaded` (503, every worker busy, with
Retry-After).
"""

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynamograph.protocol.engine import EngineConfig, Role
from dynamograph.protocol.kv_events import Batch
from dynamograph.protocol.nvext import SessionAction, SessionControl
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.router_config import RouterConfig

from .active import ActiveRequests, RequestGuard, Slot
from .errors import InvalidPin, NoEligibleWorker, Overloaded, RoutingError
from .fleet import Candidates, Fleet, WorkerState
from .index import KvIndex, as_u64, chain_keys
from .plugins.base import Context, Phase
from .prefills import prefill_marks
from .profile import build_profile
from .seqtrack import GapInfo, SequenceTracker, Verdict
from .sessions import Binding, StickySessions

__all__ = [
    "Decision",
    "GapInfo",
    "NoEligibleWorker",
    "Overloaded",
    "Pick",
    "RequestGuard",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RoutingError",
    "WorkerState",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouteRequest:
    """What the scheduler needs to know about one request.

    `block_hashes` are `protocol.hashing.block_hash_array(tokens, router.block_size,
    lora_name)`: a uint64 array (a list of the same ints works too, converted once a schedule).
    """

    request_id: str
    block_hashes: "Sequence[int] | np.ndarray"
    isl_tokens: int
    lora_name: str | None = None
    pins: RoutePins = field(default_factory=RoutePins)
    session: SessionControl | None = None
    allowed_ids: frozenset[int] | None = None  # e.g. the GAIE subset hint, as instance ids
    expected_output_tokens: int | None = None  # nvext.agent_hints.osl
    # tokens the answer may take (max_tokens; vLLM's default, the rest of the context: 1)
    # and whether `isl_tokens` is exact (not estimated past a cut): the context filter's inputs
    max_tokens: int = 1
    isl_exact: bool = True
    query_only: bool = False  # decide, but book nothing and record nothing
    # the router's config with the request's `nvext.router_config_override` applied
    # (`RouterConfig.overridden`); None: the router's own
    config: RouterConfig | None = None
    prompt_tokens: "np.ndarray | None" = None  # kept only for query-only requests (answered)


@dataclass(frozen=True, slots=True)
class Pick:
    worker_id: int
    dp_rank: int
    overlap_blocks: int  # prompt blocks cached on this slot (or held by its live requests)
    cost: float | None = None  # the KV policy's cost; None when pinned or not costed
    pinned: bool = False
    sticky: bool = False


@dataclass(slots=True)
class Decision:
    """Where a request goes. `prefill` is set only for a disaggregated decision."""

    decode: Pick
    prefill: Pick | None = None
    guard: RequestGuard | None = None  # None for query-only requests
    fallback_reason: str | None = None  # why a disaggregated pool served aggregated
    # `session_control.action: open`: binds the session once the engine accepted the turn
    session_open: Callable[[], None] | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def confirm_session(self) -> None:
        """The engine accepted the request (its answer is a success): an `open` session binds
        now, as Dynamo binds once the worker's session open succeeded. Idempotent; nothing
        to do for other requests."""
        if self.session_open is not None:
            self.session_open()
            self.session_open = None


UNKNOWN_TOTAL_BLOCKS = 1 << 40  # an engine that does not say its KV capacity
_NO_MATCHES = np.zeros((0, 2), np.int64)
_NO_KEYS = np.zeros(0, np.uint64)


class Router:
    """Worker table + KV index + active requests + the plugin pipeline."""

    def __init__(
        self, config: RouterConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or RouterConfig()
        self.index = KvIndex()
        self.active = ActiveRequests(track_output_blocks=self.config.track_output_blocks)
        self._clock = clock
        self._rng = random.Random(self.config.seed)
        self.profile = build_profile(self.config)  # ValueError names a bad plugin or parameter
        self._workers: dict[int, WorkerState] = {}
        self._fleet: Fleet | None = None  # the workers as columns; None: rebuild before use
        self._lora_ids: dict[int, dict[int, str]] = {}
        self._block_size: int | None = None
        self._seqs = SequenceTracker()
        self.sessions = StickySessions(self.config.session_ttl_s, self.config.max_sessions, clock)

    # -- workers -------------------------------------------------------------------------
    def add_engine(self, config: EngineConfig) -> bool:
        """Register a worker from what it says about itself at /v1/engine (discovery's record).

        False, logged, when the router refuses it (a block size unlike the pool's): the worker
        then stays out of routing instead of corrupting the index.
        """
        try:
            self.add_worker(
                config.instance_id,
                role=config.role,
                dp_size=config.data_parallel_size,
                block_size=config.kv_cache_block_size,
                # unknown capacity: the booked share of it counts as nothing, so KV usage is
                # the engine's scraped metric alone
                total_blocks=config.total_kv_blocks or UNKNOWN_TOTAL_BLOCKS,
                lora_names=config.lora_adapters,
                context_length=config.context_length,
            )
        except ValueError as exc:
            log.error("worker %s not added: %s", config.name, exc)
            return False
        return True

    def add_worker(
        self,
        worker_id: int,
        *,
        role: Role = Role.AGGREGATED,
        dp_size: int = 1,
        block_size: int,
        total_blocks: int,
        lora_names: Mapping[int, str] | Iterable[str] = (),
        context_length: int | None = None,
    ) -> None:
        """Register (or update) a worker. `lora_names`: the adapters it serves, as a mapping
        vLLM lora_id → name, or names in load order (ids 1, 2, …, vLLM's assignment);
        `context_length`: its max model length, None when unknown. All workers must share one
        block size (ValueError otherwise)."""
        if dp_size < 1 or block_size < 1 or total_blocks < 1:
            raise ValueError("dp_size, block_size and total_blocks must be positive")
        others = {w.block_size for wid, w in self._workers.items() if wid != worker_id}
        if others and block_size not in others:
            raise ValueError(
                f"worker {worker_id} has KV block size {block_size} but the pool uses "
                f"{others.pop()}: one router indexes one block size"
            )
        ids = (
            dict(lora_names) if isinstance(lora_names, Mapping) else dict(enumerate(lora_names, 1))
        )
        old = self._workers.get(worker_id)
        state = WorkerState(
            worker_id=worker_id,
            role=Role(role),
            dp_size=dp_size,
            block_size=block_size,
            total_blocks=total_blocks,
            lora_names=frozenset(ids.values()),
            ready=old.ready if old else True,
            context_length=context_length,
            waiting=[0] * dp_size,
            running=[0] * dp_size,
            kv_usage=[0.0] * dp_size,
        )
        if old is not None:
            for rank in range(dp_size, old.dp_size):  # ranks that went away
                self._drop_slot((worker_id, rank))
            for name in ("waiting", "running", "kv_usage"):
                kept = getattr(old, name)[:dp_size]
                getattr(state, name)[: len(kept)] = kept
        self._workers[worker_id] = state
        self._fleet = None
        self._lora_ids[worker_id] = ids
        self._block_size = self.active.block_size = block_size

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker: its index state, sequence tracking and booked load."""
        state = self._workers.pop(worker_id, None)
        self._lora_ids.pop(worker_id, None)
        if state is None:
            return
        self._fleet = None
        for rank in range(state.dp_size):
            self._drop_slot((worker_id, rank))
        if not self._workers:
            self._block_size = None

    def _drop_slot(self, slot: Slot) -> None:
        self.index.remove_slot(slot)
        self._seqs.forget(slot)
        self.active.drop_slot(slot)

    def set_ready(self, worker_id: int, ready: bool) -> None:
        state = self._worker(worker_id)
        state.ready = ready
        if self._fleet is not None:
            self._fleet.set_ready(worker_id, state.dp_size, ready)

    def update_load(
        self,
        worker_id: int,
        dp_rank: int = 0,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Scraped engine metrics (vllm:num_requests_waiting/running, kv_cache_usage_perc)."""
        state = self._worker(worker_id)
        self._check_rank(state, dp_rank)
        if waiting is not None:
            state.waiting[dp_rank] = waiting
            if self._fleet is not None:
                self._fleet.set_waiting(worker_id, dp_rank, waiting)
        if running is not None:
            state.running[dp_rank] = running
        if kv_usage is not None:
            state.kv_usage[dp_rank] = kv_usage
            if self._fleet is not None:
                self._fleet.set_kv_usage(worker_id, dp_rank, kv_usage)

    @property
    def block_size(self) -> int | None:
        """The pool's KV block size (None before the first worker): hash requests with it."""
        return self._block_size

    def workers(self) -> dict[int, WorkerState]:
        return dict(self._workers)

    def _worker(self, worker_id: int) -> WorkerState:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"worker {worker_id} is not registered") from None

    @staticmethod
    def _check_rank(state: WorkerState, dp_rank: int) -> None:
        if not 0 <= dp_rank < state.dp_size:
            raise ValueError(
                f"worker {state.worker_id} has data-parallel ranks 0..{state.dp_size - 1}, "
                f"not {dp_rank}"
            )

    # -- KV events -----------------------------------------------------------------------
    def apply_kv_batch(self, worker_id: int, seq: int, batch: Batch) -> GapInfo | None:
        """Apply one ZMQ batch in sequence order. Returns GapInfo when batches were missed: the
        caller replays from `gap.start_seq` (feeding the replayed batches here); if replay
        cannot fill the gap, it calls `replay_failed`. Batches of unknown workers are dropped."""
        state = self._workers.get(worker_id)
        if state is None:
            log.debug("KV batch %d of unknown worker %d dropped", seq, worker_id)
            return None
        rank = batch.data_parallel_rank or 0
        if rank >= state.dp_size:
            log.warning(
                "worker %d: KV batch for dp rank %d of %d dropped", worker_id, rank, state.dp_size
            )
            return None
        slot = (worker_id, rank)
        verdict = self._seqs.check(slot, seq)
        if verdict is Verdict.GAP:
            expected = self._seqs.expected(slot)
            assert expected is not None
            return GapInfo(worker_id, rank, expected, seq)
        if verdict is Verdict.DUPLICATE:
            return None
        if verdict is Verdict.RESTART:
            log.info("worker %d rank %d: KV event sequence restarted; clearing", worker_id, rank)
            self.index.clear(slot)
        # the blocks' keys matter only to prefills on the slot that wait for them
        awaited = self.active.awaits_stored_blocks(slot)
        stored = self.index.apply_batch(
            slot, batch, state.block_size, self._lora_ids.get(worker_id), want_stored=awaited
        )
        self.active.progressed(slot)
        for keys in stored:  # prefills settled by the blocks
            self.active.blocks_stored(slot, keys)
        return None

    def replay_failed(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Replay could not fill a gap: clear that worker's (rank's) blocks and restart tracking."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        ranks = range(state.dp_size) if dp_rank is None else [dp_rank]
        for rank in ranks:
            self.index.clear((worker_id, rank))
            self._seqs.forget((worker_id, rank))

    # -- scheduling ----------------------------------------------------------------------
    def _current_fleet(self) -> Fleet:
        fleet = self._fleet
        if fleet is None or fleet.index_columns != self.index.column_count:
            fleet = self._fleet = Fleet(self._workers.values(), self.index, self.active)
        return fleet

    def schedule(self, request: RouteRequest) -> Decision:
        """Pick decode (and, disaggregated, prefill) slots and book them unless query-only.

        Raises NoEligibleWorker (503) or Overloaded (503, with Retry-After)."""
        if self._block_size is None:
            raise NoEligibleWorker("no worker is registered")
        now = self._clock()
        if not self.config.use_kv_events:
            self.index.expire(now)
        fleet = self._current_fleet()
        # converted once: the prompt's keys need every block anyway (a list would otherwise be
        # converted again, in stages, by the index's walk)
        hashes = as_u64(request.block_hashes)
        has_blocks = hashes.size > 0
        matches = self.index.match_columns(hashes) if has_blocks else _NO_MATCHES
        prompt_keys = chain_keys(0, hashes) if has_blocks else _NO_KEYS
        # every hashed block is a prompt block, whatever isl_tokens says
        prompt_blocks = max(-(-request.isl_tokens // self._block_size), len(prompt_keys))
        output_blocks = 0  # agent_hints.osl: the expected output is booked (and costed) too
        if request.expected_output_tokens:
            output_blocks = -(-request.expected_output_tokens // self._block_size)
        config, weights = request.config or self.config, None
        if config.scorers is not self.config.scorers:  # an overlap weight of the request's own
            weights = tuple(ref.weight for ref in config.scorers)
        self.active.reap()
        candidates = fleet.candidates(matches, self.active, prompt_keys, config.booked_prefix_hits)

        def context(phase: Phase) -> Context:
            return Context(
                phase=phase,
                prompt_blocks=prompt_blocks,
                lora_name=request.lora_name,
                allowed_ids=request.allowed_ids,
                output_blocks=output_blocks if phase != Phase.PREFILL else 0,
                config=config,
                rng=self._rng,
                block_size=self._block_size or 0,
                weights=weights,
                prompt_tokens=request.isl_tokens if request.isl_exact else None,
                max_tokens=request.max_tokens if phase != Phase.PREFILL else 1,  # prefill: 1
            )

        pins = request.pins
        fallback = None
        prefill: Pick | None = None
        disagg = self._disaggregated(request, fleet)
        if isinstance(disagg, str):
            fallback, disagg = disagg, False
        session = request.session
        binding = self.sessions.bound(session.session_id, now) if session is not None else None
        # Each phase is sticky on its own; a pin of that phase's worker or rank (headers,
        # backend_instance_id, decode/prefill_worker_id, dp_rank, prefill_dp_rank) turns its
        # stickiness off, and the pin does not move the binding.
        moved: dict[Phase, Pick] = {}
        if disagg:
            ctx = context(Phase.PREFILL)
            prefill_pinned = pins.prefill_worker_id is not None or pins.prefill_dp_rank is not None
            prefill = None
            if binding is not None and not prefill_pinned and binding.prefill is not None:
                prefill = self._sticky(ctx, candidates, binding.prefill)
            if prefill is None:
                prefill = self._select(
                    ctx, candidates, pins.prefill_worker_id, pins.prefill_dp_rank
                )
                if (
                    binding is not None
                    and not prefill_pinned
                    and (binding.prefill is None or not self._alive(binding.prefill))
                ):
                    moved[Phase.PREFILL] = prefill
        ctx = context(Phase.DECODE if disagg else Phase.AGGREGATED)
        decode_pinned = pins.worker_id is not None or pins.dp_rank is not None
        decode = None
        if binding is not None and not decode_pinned:
            decode = self._sticky(ctx, candidates, binding.decode)
        if decode is None:
            decode = self._select(ctx, candidates, pins.worker_id, pins.dp_rank)
            if binding is not None and not decode_pinned and not self._alive(binding.decode):
                moved[Phase.DECODE] = decode
        decision = Decision(decode=decode, prefill=prefill, fallback_reason=fallback)
        if request.query_only:
            return decision
        if session is not None:
            self._session_turn(session, binding, decision, moved, now)
        decision.guard = self._book(request, decision, prompt_blocks, prompt_keys)
        decision.guard.on_accepted = decision.confirm_session if decision.session_open else None
        if not self.config.use_kv_events and has_blocks:
            expires = now + self.config.approx_ttl_s
            for pick in (prefill, decode):
                if pick is not None:
                    self.index.record((pick.worker_id, pick.dp_rank), hashes, expires)
        return decision

    def _disaggregated(self, request: RouteRequest, fleet: Fleet) -> bool | str:
        """True: pick prefill and decode; False: aggregated; a string: fallback, and why."""
        if request.pins.prefill_worker_id is not None:
            return True
        if not fleet.has_prefill:
            if self.config.enforce_disagg:
                raise NoEligibleWorker(
                    "disaggregation is enforced but no prefill worker is registered"
                )
            return False
        if fleet.any_prefill_ready():
            return True
        if self.config.enforce_disagg:
            raise NoEligibleWorker("disaggregation is enforced but no prefill worker is ready")
        log.debug("no prefill worker is ready; serving aggregated")
        return "no prefill worker is ready"

    def _select(
        self, ctx: Context, c: Candidates, pinned_worker: int | None, pinned_rank: int | None
    ) -> Pick:
        profile = self.profile
        if pinned_worker is not None:
            return self._pinned(ctx, c, pinned_worker, pinned_rank)
        at = profile.eligible(ctx, c)
        if pinned_rank is not None:
            # a rank pinned without its worker: the selection runs over the slots of that rank
            ranks = np.fromiter((rank for _, rank in c.fleet.slots), np.int64, len(c.fleet))
            at = at[ranks[at] == pinned_rank]
            if not len(at):
                raise NoEligibleWorker(
                    f"no eligible {ctx.phase.value} worker has data-parallel rank {pinned_rank}"
                )
        profile.score(ctx, c)
        chosen = profile.picker.pick(ctx, c, at)
        if log.isEnabledFor(logging.DEBUG):
            _log_choice(ctx, c, chosen, at)
        return _pick(c, chosen)

    def _pinned(self, ctx: Context, c: Candidates, worker_id: int, dp_rank: int | None) -> Pick:
        """A pinned phase skips the filters and the picker; an unpinned rank goes to the cost."""
        state = self._workers.get(worker_id)
        if state is None:
            raise NoEligibleWorker(f"pinned {ctx.phase.value} worker {worker_id} is not registered")
        # The role is the one constraint a pin cannot skip: a prefill leg sent to a worker that
        # does not hand KV off (or a decode leg to a prefill worker) fails at the engine.
        if (ctx.phase == Phase.PREFILL) != (state.role == Role.PREFILL):
            wanted = (
                "a prefill worker"
                if ctx.phase == Phase.PREFILL
                else "an aggregated or decode worker"
            )
            hint = (
                ""
                if c.fleet.has_prefill or ctx.phase != Phase.PREFILL
                else "; this pool has no prefill workers: drop the prefill pin"
            )
            raise InvalidPin(
                f"pinned {ctx.phase.value} worker {worker_id} is a {state.role.value} worker, "
                f"not {wanted}{hint}"
            )
        ranks = c.fleet.positions(worker_id, state.dp_size)
        if dp_rank is not None:
            try:
                self._check_rank(state, dp_rank)
            except ValueError as exc:
                raise NoEligibleWorker(f"pinned {exc}") from None
            ranks = ranks[dp_rank : dp_rank + 1]
        self.profile.score(ctx, c)
        chosen = self.profile.cost_picker.pick(ctx, c, np.arange(ranks.start, ranks.stop))
        pick = _pick(c, chosen)
        return Pick(pick.worker_id, pick.dp_rank, pick.overlap_blocks, pick.cost, pinned=True)

    # -- sticky sessions -----------------------------------------------------------------
    def _alive(self, slot: Slot) -> bool:
        wid, rank = slot
        state = self._workers.get(wid)
        return state is not None and rank < state.dp_size and state.ready

    def _sticky(self, ctx: Context, c: Candidates, slot: Slot) -> Pick | None:
        """A phase's bound slot, when it still passes the request's hard constraints (role,
        ready, LoRA adapter, subset); load does not move a session (the busy filter and the
        other configured filters are not applied), as in Dynamo."""
        wid, rank = slot
        state = self._workers.get(wid)
        if state is None or rank >= state.dp_size:
            return None
        position = c.fleet.first[wid] + rank
        if not self.profile.passes_hard_constraints(ctx, c, position):
            return None
        return Pick(wid, rank, int(c.overlap[position]), None, sticky=True)

    def _session_turn(
        self,
        session: SessionControl,
        binding: Binding | None,
        decision: Decision,
        moved: dict[Phase, Pick],
        now: float,
    ) -> None:
        """What a routed turn does to its session's binding (`sessions` module docstring)."""
        sid = session.session_id
        action = session.action
        decode = (decision.decode.worker_id, decision.decode.dp_rank)
        prefill = None
        if decision.prefill is not None:
            prefill = (decision.prefill.worker_id, decision.prefill.dp_rank)
        if action == SessionAction.CLOSE:
            self.sessions.unbind(sid)
        elif binding is not None:  # a turn (or a repeated open/bind) of a bound session
            self.sessions.refresh(
                sid,
                now,
                decode=decode if Phase.DECODE in moved else None,
                prefill=prefill if Phase.PREFILL in moved else None,
            )
        elif action == SessionAction.BIND:
            self.sessions.bind(session, decode, prefill, now)
        elif action == SessionAction.OPEN:
            sessions = self.sessions

            def bind_open() -> None:
                sessions.bind(session, decode, prefill, self._clock())

            decision.session_open = bind_open

    # -- booking -------------------------------------------------------------------------
    def _book(
        self,
        request: RouteRequest,
        decision: Decision,
        prompt_blocks: int,
        prompt_keys: np.ndarray,
    ) -> RequestGuard:
        decode = decision.decode
        prefill = decision.prefill
        uncached = max(prompt_blocks - (prefill or decode).overlap_blocks, 0)
        prefill_booking = None
        if prefill is not None:
            prefill_booking = self.active.book(
                (prefill.worker_id, prefill.dp_rank),
                prompt_blocks=prompt_blocks,
                prompt_keys=prompt_keys,
                prefill_blocks=uncached,
            )
        decode_booking = self.active.book(
            (decode.worker_id, decode.dp_rank),
            prompt_blocks=prompt_blocks,
            prompt_keys=prompt_keys,
            prefill_blocks=0 if prefill is not None else uncached,
            expected_output_tokens=request.expected_output_tokens,
        )
        if self.config.use_kv_events:
            marks = prefill_marks(prompt_keys, (prefill or decode).overlap_blocks, prompt_blocks)
            self.active.watch_prefill(prefill_booking or decode_booking, marks)
        return RequestGuard(self.active, request.request_id, decode_booking, prefill_booking)


def _pick(c: Candidates, position: int) -> Pick:
    worker_id, dp_rank = c.fleet.slots[position]
    cost = 0.0 if c.cost is None else float(c.cost[position])
    return Pick(worker_id, dp_rank, int(c.overlap[position]), cost)


def _log_choice(ctx: Context, c: Candidates, chosen: int, at: np.ndarray) -> None:
    """Why a selection went where it did: the chosen slot and the cheapest others' cost terms."""
    costs = c.cost if c.cost is not None else np.zeros(len(c.fleet))
    others = sorted((p for p in at.tolist() if p != chosen), key=costs.__getitem__)[:3]
    log.debug(
        "%s pick %s of %d blocks: %s; next: %s",
        ctx.phase.value,
        c.fleet.slots[chosen],
        ctx.prompt_blocks,
        _terms(c, costs, chosen),
        ", ".join(f"{c.fleet.slots[p]} {_terms(c, costs, p)}" for p in others) or "none",
    )


def _terms(c: Candidates, costs: np.ndarray, p: int) -> str:
    terms = " ".join(f"{name}={column[p]:g}" for name, column in c.terms.items())
    return f"overlap={c.overlap[p]} {terms} cost={costs[p]:g} requests={c.requests[p]}"
