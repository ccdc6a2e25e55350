"""One simulated GPU engine (one data-parallel rank): the step loop tying the pieces together.

Each iteration asks the scheduler for a step, charges its cost-model time on the simulated
clock (sleeping `time / speedup` of wall clock), samples one token for every sequence that
completed its tokens, streams outputs, finishes requests, and publishes the step's KV events as
one batch. Requests enter with `submit`, leave with a terminal chunk on their collector.

Simulated time: while the engine is busy the clock advances by exactly the modelled step
times, so the simulated TTFT/ITL of a request depend only on the schedule (reproducible);
when idle it re-synchronises with wall clock × speedup. The wall-clock sleep targets absolute
deadlines, so per-step overheads do not accumulate into drift (`dynamograph bench worker`).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynamograph.protocol.nvext import SessionAction, SessionControl

from .cost import CostModel
from .engine import (
    EngineOutput,
    FinishReason,
    GenerateRequest,
    OutputCollector,
    RequestContext,
    Timing,
    Usage,
)
from .events import KvEventPublisher
from .handoff import HeldBlocks, PendingTransfers, hold_key
from .kv_cache import KvCache
from .metrics import RankGauges, WorkerMetrics
from .sampler import OutputSampler, TokenStream
from .scheduler import Scheduler, Sequence, StepPlan
from .sessions import SessionPins

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 0.5
MIN_SLEEP = 0.001


class SimClock:
    """Simulated seconds since start; runs `speedup` times faster than the wall clock."""

    def __init__(self, speedup: float):
        if speedup <= 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        self.speedup = speedup
        self._wall0 = time.monotonic()
        self.now = 0.0

    def wall_sim(self) -> float:
        return (time.monotonic() - self._wall0) * self.speedup

    def sync(self) -> None:
        """Catch up with the wall clock (after idling)."""
        self.now = max(self.now, self.wall_sim())

    def wall_delay(self, sim_time: float) -> float:
        """Wall seconds until the simulated time `sim_time` is due."""
        return self._wall0 + sim_time / self.speedup - time.monotonic()

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        delay = self.wall_delay(self.now)
        # The event loop's timers are as coarse as epoll's 1 ms: shorter waits only yield, and
        # the absolute deadline of the next step absorbs the difference (no drift builds up).
        await asyncio.sleep(delay if delay >= MIN_SLEEP else 0)


@dataclass(eq=False)
class RequestState:
    request: GenerateRequest
    ctx: RequestContext
    seq: Sequence
    tokens: TokenStream
    timing: Timing
    outputs: OutputCollector
    hold_for_decode: bool = False
    session: SessionControl | None = None
    first_scheduled: float | None = None
    last_token_at: float | None = None
    finished: bool = False


ParamsFactory = Callable[[int, str, list[int]], dict[str, Any]]


class EngineRank:
    def __init__(
        self,
        rank: int,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cost: CostModel,
        clock: SimClock,
        sampler: OutputSampler,
        publisher: KvEventPublisher | None,
        metrics: WorkerMetrics | None,
        transfer_timeout: float,
        handoff_params: ParamsFactory,
        max_loras: int | None = None,
        priority_policy: bool = True,
    ):
        self.rank = rank
        self.cost = cost
        self.clock = clock
        self.sampler = sampler
        self.cache = KvCache(num_blocks, block_size)
        self.scheduler = Scheduler(cache=self.cache, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   transfer_time=cost.transfer_time,
                                   max_loras=max_loras,
                                   priority_policy=priority_policy)  # fmt: skip
        self.publisher = publisher
        self._m = metrics.for_rank(rank) if metrics is not None else None
        self.transfers = PendingTransfers(transfer_timeout)
        self.sessions = SessionPins()
        self._handoff_params = handoff_params
        self._states: dict[str, RequestState] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.steps = 0
        self.busy_time = 0.0  # simulated seconds spent computing steps

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._sweep())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for state in list(self._states.values()):
            self._finish(state, FinishReason.CANCELLED, "engine shut down")
        if self.publisher is not None:
            await self.publisher.close()

    # -- queries -------------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    def gauges(self) -> RankGauges:
        s = self.scheduler
        return RankGauges(
            len(s.running), len(s.waiting) + len(s.loading), self.cache.usage,
            running_loras=s.active_loras(),
            waiting_loras={q.lora_name for q in s.waiting if q.lora_name},
        )  # fmt: skip

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    # -- requests ------------------------------------------------------------------------------

    def submit(self, request: GenerateRequest, ctx: RequestContext, remote_tokens: int = 0,
               hold_for_decode: bool = False) -> RequestState:  # fmt: skip
        if request.request_id in self._states:
            raise ValueError(f"request id {request.request_id!r} is already running")
        seq = Sequence(
            request_id=request.request_id,
            prompt=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_size=self.cache.block_size,
            lora_name=request.lora_name,
            lora_id=request.lora_id,
            remote_tokens=remote_tokens,
            priority=request.priority,
        )
        if not (self.scheduler.running or self.scheduler.waiting):
            self.clock.sync()  # the modelled GPU was idle until now
        arrival = min(self.clock.now, self.clock.wall_sim())
        state = RequestState(
            request=request,
            ctx=ctx,
            seq=seq,
            tokens=self.sampler.stream(request.prompt_tokens, request.seed),
            timing=Timing(arrival=arrival),
            outputs=OutputCollector(final_only=request.final_only),
            hold_for_decode=hold_for_decode,
            session=request.nvext.session_control if request.nvext else None,
        )
        seq.handle = state
        self._states[request.request_id] = state
        self.scheduler.add(seq)
        self._wake.set()
        return state

    def abort(self, request_id: str) -> bool:
        state = self._states.get(request_id)
        if state is None:
            return False
        self._finish(state, FinishReason.CANCELLED, "request cancelled")
        return True

    def cancel(self, state: RequestState) -> None:
        """Abort this request (no-op once it finished)."""
        self._finish(state, FinishReason.CANCELLED, "request cancelled")

    async def wait_transfer(self, request_id: str, wait_s: float) -> HeldBlocks | None:
        """A bootstrap pull: the held prefill once it is held (within `wait_s` seconds)."""
        if await self.transfers.wait(request_id, wait_s):
            return self.take_transfer(request_id)
        return None

    def take_transfer(self, request_id: str) -> HeldBlocks | None:
        """A decode engine pulls a held prefill: hand over the hashes and free the blocks."""
        held = self.transfers.take(request_id)
        if held is not None:
            self.cache.release(held.blocks)
            self._wake.set()
        return held

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        self._publish()
        return ok

    # -- the step loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()  # submit() synchronised the clock
                continue
            plan = self.scheduler.schedule(self.clock.now)
            self._account_schedule(plan)
            if not plan.scheduled:
                if plan.preempted:  # the last runner gave way: admit from the queue next
                    continue
                await self._idle_step()
                self._publish()
                continue
            step = self.cost.step_time(*plan.cost_inputs())
            await self.clock.advance(step)
            self.steps += 1
            self.busy_time += step
            for seq in self.scheduler.complete(plan):
                self._emit_token(seq.handle)
            self._publish()

    async def _idle_step(self) -> None:
        """Nothing can run: wait for a transfer to land, new work, or blocks to be freed.

        When nothing runs and the head request still cannot get blocks, only session pins and
        prefills held for their decode occupy the cache: pins give way (oldest first); held
        prefills are waited for (a pull or the transfer timeout frees them), as vLLM waits.
        """
        ready = self.scheduler.next_ready()
        if ready is None and not self.scheduler.running and self.scheduler.waiting:
            blocks = self.sessions.evict_oldest()
            if blocks:
                self.cache.release(blocks)
                return
        self._wake.clear()
        timeout = None if ready is None else max(0.0, self.clock.wall_delay(ready))
        woken = True
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            woken = False
        if ready is None:
            self.clock.sync()
        elif woken:  # early: simulated time passed as wall time, but not beyond the transfer
            self.clock.now = max(self.clock.now, min(self.clock.wall_sim(), ready))
        else:
            self.clock.now = max(self.clock.now, ready)

    def _account_schedule(self, plan: StepPlan) -> None:
        for s in plan.scheduled:
            state: RequestState = s.seq.handle
            if state.first_scheduled is None:
                state.first_scheduled = self.clock.now
                state.timing.queue_time = self.clock.now - state.timing.arrival
        for seq in plan.loaded:
            state = seq.handle
            state.timing.transfer_time = self.cost.transfer_time(seq.num_remote_loaded)
        m = self._m
        if m is not None:
            if plan.preempted:
                m.preemptions.inc(len(plan.preempted))
            stats = self.scheduler.stats
            if stats.queries:
                m.prefix_queries.inc(stats.queries)
                m.prefix_hits.inc(stats.hits)
        self.scheduler.stats.queries = self.scheduler.stats.hits = 0

    def _emit_token(self, state: RequestState) -> None:
        token, text = state.tokens.next()
        seq = state.seq
        seq.append(token)
        now = self.clock.now
        if self._m is not None:
            self._m.generation_tokens.inc()
            if state.last_token_at is not None:
                self._m.itl.observe(now - state.last_token_at)
        if state.timing.first_token is None:
            state.timing.first_token = now
            if self._m is not None:
                self._m.prompt_tokens.inc(seq.prompt_len)  # as vLLM: once, cached included
            state.timing.prefill_time = now - (state.first_scheduled or now)
        state.last_token_at = now
        if seq.num_output >= seq.max_tokens:
            self._finish(state, FinishReason.LENGTH, token=token, text=text)
        else:
            state.outputs.put(EngineOutput(token_ids=[token], text=text, dp_rank=self.rank))

    def _finish(self, state: RequestState, reason: FinishReason, error: str | None = None,
                token: int | None = None, text: str = "") -> None:  # fmt: skip
        if state.finished:
            return
        state.finished = True
        self._states.pop(state.request.request_id, None)
        seq = state.seq
        blocks = self.scheduler.remove(seq)
        kv_params = None
        if reason is FinishReason.LENGTH and state.hold_for_decode:
            # Keep the prompt's blocks for the decode engine's pull (vLLM's delay_free_blocks).
            full = seq.num_committed
            self.cache.release(blocks[full:])
            key = hold_key(seq.request_id, state.request.kv_transfer_params)
            self.transfers.hold(key, blocks[:full], seq.hashes[:full], seq.prompt_len)
            kv_params = self._handoff_params(self.rank, key, blocks[:full])
        elif reason in (FinishReason.LENGTH, FinishReason.STOP) and state.session is not None:
            self._pin_session(state.session, blocks[: seq.num_committed])
            self.cache.release(blocks[seq.num_committed :])
        else:
            self.cache.release(blocks)
            if state.session is not None and state.session.action is SessionAction.CLOSE:
                self.cache.release(self.sessions.close(state.session.session_id))
        timing = state.timing
        timing.finished = self.clock.now
        cached = max(seq.num_cached_tokens, 0) + seq.num_remote_loaded
        usage = Usage(seq.prompt_len, seq.num_output, min(cached, seq.prompt_len))
        state.outputs.put(
            EngineOutput(
                token_ids=[] if token is None else [token],
                text=text,
                finish_reason=reason,
                error=error,
                usage=usage,
                timing=timing,
                dp_rank=self.rank,
                kv_transfer_params=kv_params,
            )
        )
        self._observe_finished(state, reason)
        self._wake.set()

    def _pin_session(self, session: SessionControl, blocks: list[int]) -> None:
        if session.action is SessionAction.CLOSE:
            self.cache.release(blocks)
            self.cache.release(self.sessions.close(session.session_id))
            return
        if session.action is not SessionAction.OPEN and session.session_id not in self.sessions:
            self.cache.release(blocks)  # a turn of a session this rank does not hold
            return
        self.cache.release(self.sessions.pin(session.session_id, blocks, session.timeout))

    def _observe_finished(self, state: RequestState, reason: FinishReason) -> None:
        m = self._m
        if m is None:
            return
        if reason is FinishReason.CANCELLED:
            m.success("abort").inc()  # vLLM's name for requests that did not run to the end
            return
        m.success(reason.value).inc()
        t = state.timing
        if t.ttft is not None:
            m.ttft.observe(t.ttft)
            m.queue_time.observe(t.queue_time)
            m.prefill_time.observe(t.prefill_time)
        if t.e2e is not None:
            m.e2e.observe(t.e2e)

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    async def _sweep(self) -> None:
        """Free prefills nobody pulled and sessions nobody used within their timeouts."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            freed = False
            for held in self.transfers.expired():
                log.warning("rank %d: freed %d blocks of a prefill whose decode never came",
                            self.rank, len(held.blocks))  # fmt: skip
                self.cache.release(held.blocks)
                freed = True
            for blocks in self.sessions.expired():
                self.cache.release(blocks)
                freed = True
            if freed:
                self._wake.set()

    def release_all_holds(self) -> None:
        for held in self.transfers.drain_all():
            self.cache.release(held.blocks)
        for blocks in self.sessions.drain_all():
            self.cache.release(blocks)
        self._wake.set()
