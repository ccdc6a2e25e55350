"""`MockEngine`: the simulated GPU engine behind `dynamograph worker --engine mock`.

Holds `data_parallel_size` engine ranks (`rank.EngineRank`) in one process, picks a rank per
request (the `X-data-parallel-rank` header, else the rank holding the request's session, else
the least loaded), validates requests against the engine's limits, runs the disaggregated
hand-off (pulling a prefill's KV before a decode request enters its rank) and binds the ZMQ KV
event sockets of every rank. LoRA adapters (`lora_modules`) get vLLM's ids 1, 2, …; a request
for one hashes and caches its blocks under the adapter's name and its KV events carry the id.
"""

import asyncio
import contextlib
import functools
import ipaddress
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from dynamograph.protocol.engine import BOOTSTRAP_ROOM, EngineConfig, KvEventsEndpoint, Role
from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.kv_events import ARRAY, DEFAULT_TOPIC, LAYOUTS
from dynamograph.protocol.launch import KV_EVENTS_PORT, kv_replay_port
from dynamograph.protocol.tokenization import get_tokenizer

from .cost import CostModel
from .engine import (
    EngineError,
    EngineOutput,
    GenerateRequest,
    LLMEngine,
    RequestContext,
)
from .events import bind_publishers
from .handoff import (
    BOOTSTRAP_WAIT_S,
    DEFAULT_TRANSFER_TIMEOUT,
    PULL_PATH,
    HeldBlocks,
    engine_id,
    is_remote_prefill,
    response_params,
    wants_remote_decode,
)
from .kv_cache import chained_hashes
from .lora import LoraModule, adapter_ids, check_modules
from .metrics import WorkerMetrics
from .rank import EngineRank, SimClock
from .sampler import OutputSampler

log = logging.getLogger(__name__)


@dataclass
class MockConfig:
    model: str = "Qwen/Qwen3-0.6B"
    served_model_name: str | None = None
    tokenizer: str = "qwen"
    fast_tokenizer: bool = False  # build fastokens at start (else after ~1.5 s of encoding)
    role: Role = Role.AGGREGATED
    name: str = "mock-worker"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 8000  # the HTTP port (named in hand-off params and the engine document)
    kv_events_port: int = KV_EVENTS_PORT
    kv_replay_port: int | None = None  # None: after the last rank's events port (`replay_port`)
    kv_events: bool = True
    kv_events_layout: str = ARRAY  # one of protocol.kv_events.LAYOUTS: vLLM's encodings
    kv_events_topic: str = DEFAULT_TOPIC  # the first frame of every batch (vLLM's `topic`)
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    context_length: int = 32768
    data_parallel_size: int = 1
    speedup: float = 1.0
    seed: int = 0
    default_max_tokens: int = 128
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    cost: CostModel = field(default_factory=CostModel)
    lora_modules: list[LoraModule] = field(default_factory=list)
    max_loras: int = 1  # distinct adapters in one batch (vLLM's --max-loras)
    # vLLM's --scheduling-policy: "priority" runs the lowest request `priority` first (then
    # arrival); "fcfs" (vLLM's default) refuses a non-zero priority, as vLLM does
    scheduling_policy: str = "priority"
    # prefill: advertise a bootstrap address (its HTTP port), so frontends take the bootstrap
    # path (SGLang's: the decode leg starts at once and its pull waits for the prefill); off,
    # the hand-off is vLLM's (the decode leg after the prefill's answer)
    bootstrap: bool = False
    # Bearer token of the admin endpoints (/v1/kv_transfer/pull, /reset_prefix_cache,
    # /debug/requests), shared by a graph's workers: a decode engine pulls with it.
    admin_token: str | None = field(default=None, repr=False)
    debug_endpoints: bool = False  # serve /debug/requests and /reset_prefix_cache without one
    kv_curve: CurveKeys | None = None  # CURVE on the KV-event sockets (protocol.kv_curve)

    @property
    def served(self) -> str:
        return self.served_model_name or self.model

    @property
    def replay_port(self) -> int:
        """`kv_replay_port`, else the operator's rule (`protocol.launch.kv_replay_port`): rank
        r replays on it + r, clear of every rank's events port."""
        if self.kv_replay_port is not None:
            return self.kv_replay_port
        return kv_replay_port(self.data_parallel_size, self.kv_events_port)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def events_bind_host(self) -> str:
        """Where the KV-event and replay sockets listen: the advertised address when it is an
        IP address (a pod's IP: what the EPP connects to, and no other interface of the node),
        else --host."""
        if self.advertise_host:
            with contextlib.suppress(ValueError):
                return str(ipaddress.ip_address(self.advertise_host))
        return self.host

    def validate(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "context_length", "data_parallel_size", "default_max_tokens"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.speedup <= 0:
            raise ValueError("--speedup must be positive")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be positive")
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError("--scheduling-policy must be priority or fcfs")
        if self.kv_events_layout not in LAYOUTS:
            raise ValueError(f"--kv-events-layout must be one of {', '.join(LAYOUTS)}")
        check_modules(self.lora_modules, self.served)

    @property
    def lora_ids(self) -> dict[int, str]:
        return adapter_ids(self.lora_modules)


# Pulls a prefill's blocks: (kv_transfer_params) -> HeldBlocks-like dict or None when gone.
KvPuller = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]


class MockEngine(LLMEngine):
    def __init__(self, config: MockConfig, *, kv_puller: KvPuller | None = None):
        config.validate()
        self.config = config
        self.ranks: list[EngineRank] = []
        self.metrics: WorkerMetrics | None = None
        self.engine_config: EngineConfig | None = None
        self.instance_id: int | None = None
        self._kv_puller = kv_puller
        self._zmq: zmq.asyncio.Context | None = None
        self._zap: AsyncioAuthenticator | None = None  # admits CURVE subscribers (kv_curve)
        self._http: aiohttp.ClientSession | None = None
        self._draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._lora_id_of = {name: i for i, name in config.lora_ids.items()}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, worker_id: int) -> EngineConfig:
        if self.ranks:
            raise RuntimeError("engine already started")
        cfg = self.config
        self.instance_id = worker_id
        tokenizer = await asyncio.to_thread(get_tokenizer, cfg.tokenizer, fast=cfg.fast_tokenizer)
        self.tokenizer = tokenizer
        sampler = await asyncio.to_thread(OutputSampler, tokenizer, cfg.seed)
        self.metrics = WorkerMetrics(
            cfg.served, cfg.block_size, cfg.num_gpu_blocks,
            lambda: [(r.rank, r.gauges()) for r in self.ranks],
            max_loras=cfg.max_loras if cfg.lora_modules else None,
        )  # fmt: skip
        publishers: list = [None] * cfg.data_parallel_size
        kv_events = None
        if cfg.kv_events:
            self._zmq = zmq.asyncio.Context()
            if cfg.kv_curve is not None:
                self._zap = cfg.kv_curve.admit_subscribers(self._zmq)
            bind = functools.partial(
                bind_publishers, self._zmq, events_port=cfg.kv_events_port,
                replay_port=cfg.replay_port, ranks=cfg.data_parallel_size,
                topic=cfg.kv_events_topic, layout=cfg.kv_events_layout,
                curve=cfg.kv_curve,
            )  # fmt: skip
            try:
                publishers, ev_port, rp_port = bind(host=cfg.events_bind_host)
            except OSError as exc:
                if cfg.events_bind_host == cfg.host:
                    raise
                # An advertised address that is not this machine's (NAT, a test's): --host.
                log.warning("KV event sockets bind %s instead: %s", cfg.host, exc)
                publishers, ev_port, rp_port = bind(host=cfg.host)
            kv_events = KvEventsEndpoint(
                endpoint=f"tcp://{cfg.public_host}:{ev_port}",
                replay_endpoint=f"tcp://{cfg.public_host}:{rp_port}",
                topic=cfg.kv_events_topic,
            )
        self.ranks = [
            EngineRank(
                r,
                num_blocks=cfg.num_gpu_blocks,
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                cost=cfg.cost,
                clock=SimClock(cfg.speedup),
                sampler=sampler,
                publisher=publishers[r],
                metrics=self.metrics,
                transfer_timeout=cfg.transfer_timeout,
                handoff_params=self._handoff_params,
                max_loras=cfg.max_loras if cfg.lora_modules else None,
                priority_policy=cfg.scheduling_policy == "priority",
            )
            for r in range(cfg.data_parallel_size)
        ]
        for rank in self.ranks:
            rank.start()
        bootstrap = cfg.bootstrap and cfg.role is Role.PREFILL
        self.engine_config = EngineConfig(
            model=cfg.model,
            served_model_name=cfg.served,
            context_length=cfg.context_length,
            kv_cache_block_size=cfg.block_size,
            total_kv_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            bootstrap_host=cfg.public_host if bootstrap else None,
            bootstrap_port=cfg.port if bootstrap else None,
            instance_id=worker_id,
            name=cfg.name,
            role=cfg.role,
            data_parallel_size=cfg.data_parallel_size,
            tokenizer=tokenizer.identity,
            kv_events=kv_events,
            engine="mock",
            lora_adapters=cfg.lora_ids,
        )
        return self.engine_config

    async def drain(self, grace: float | None = None) -> None:
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)

    async def cleanup(self) -> None:
        ranks, self.ranks = self.ranks, []
        for rank in ranks:
            await rank.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    # -- requests ------------------------------------------------------------------------------

    def pick_rank(self, request: GenerateRequest) -> EngineRank:
        if request.dp_rank is not None:
            if not 0 <= request.dp_rank < len(self.ranks):
                raise EngineError(
                    400,
                    f"data parallel rank {request.dp_rank} out of range: this engine has "
                    f"ranks 0..{len(self.ranks) - 1}",
                )
            return self.ranks[request.dp_rank]
        session = request.nvext.session_control if request.nvext else None
        if session is not None:
            for rank in self.ranks:
                if rank.has_session(session.session_id):
                    return rank
        return min(self.ranks, key=lambda r: (r.load, r.cache.usage, r.rank))

    def check_limits(self, request: GenerateRequest) -> None:
        cfg = self.config
        n = len(request.prompt_tokens)
        if n == 0:
            raise EngineError(400, "the prompt is empty; send at least one token", param="prompt")
        if request.max_tokens < 1:
            raise EngineError(400, "max_tokens must be at least 1", param="max_tokens")
        if n + request.max_tokens > cfg.context_length:
            raise EngineError(
                400,
                f"This model's maximum context length is {cfg.context_length} tokens. However, "
                f"you requested {n + request.max_tokens} tokens ({n} in the messages, "
                f"{request.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
            )
        capacity = cfg.num_gpu_blocks * cfg.block_size
        if n + request.max_tokens > capacity:
            raise EngineError(
                400,
                f"request needs {n + request.max_tokens} tokens of KV cache but this engine "
                f"holds at most {capacity} ({cfg.num_gpu_blocks} blocks of {cfg.block_size})",
                param="max_tokens",
            )

    async def generate(
        self, request: GenerateRequest, ctx: RequestContext
    ) -> AsyncGenerator[EngineOutput, None]:
        if not self.ranks:
            raise EngineError(503, "engine is not running")
        if self._draining:
            raise EngineError(503, "engine is draining; send the request to another worker")
        self.check_limits(request)
        if request.lora_name:
            request.lora_id = self._lora_id_of.get(request.lora_name)
            if request.lora_id is None:
                raise EngineError(
                    404, f"The model `{request.lora_name}` does not exist.", param="model"
                )
        rank = self.pick_rank(request)
        role = self.config.role
        params = request.kv_transfer_params
        hold = role is Role.PREFILL and wants_remote_decode(params)
        remote_tokens = 0
        self._inflight += 1
        self._idle.clear()
        try:
            if role is Role.DECODE and is_remote_prefill(params):
                remote_tokens = await self._pull(request, params)
            state = rank.submit(request, ctx, remote_tokens=remote_tokens, hold_for_decode=hold)
            ctx.on_cancel(lambda: rank.cancel(state))
            try:
                while True:
                    chunk = await state.outputs.get()
                    yield chunk
                    if chunk.is_terminal:
                        return
            finally:
                # Closed early (the client went away): free the request's blocks.
                rank.cancel(state)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    @property
    def draining(self) -> bool:
        return self._draining

    def has_request(self, request_id: str) -> bool:
        return any(rank.has_request(request_id) for rank in self.ranks)

    async def abort(self, request_id: str) -> bool:
        return any(rank.abort(request_id) for rank in self.ranks)

    # -- disaggregation ------------------------------------------------------------------------

    def _handoff_params(self, rank: int, request_id: str, blocks: list[int]) -> dict[str, Any]:
        return response_params(
            instance_id=self.instance_id or 0,
            dp_rank=rank,
            request_id=request_id,
            block_ids=blocks,
            host=self.config.public_host,
            port=self.config.port,
        )

    def _rank_of(self, remote_engine_id: str) -> EngineRank | None:
        for rank in self.ranks:
            if engine_id(self.instance_id or 0, rank.rank) == remote_engine_id:
                return rank
        return None

    def take_transfer(self, remote_engine_id: str, request_id: str) -> HeldBlocks | None:
        """Serve a decode engine's pull (the prefill side of the hand-off)."""
        rank = self._rank_of(remote_engine_id)
        return rank.take_transfer(request_id) if rank is not None else None

    async def wait_transfer(
        self, remote_engine_id: str, request_id: str, wait_s: float
    ) -> HeldBlocks | None:
        """A bootstrap pull: `take_transfer` once the prefill holds the blocks, waiting up to
        `wait_s` seconds for it."""
        rank = self._rank_of(remote_engine_id)
        if rank is None:
            return None
        return await rank.wait_transfer(request_id, min(wait_s, self.config.transfer_timeout))

    async def _pull(self, request: GenerateRequest, params: dict[str, Any]) -> int:
        """Pull the prefill's KV; returns how many prompt tokens need no recompute.

        Only blocks whose hashes equal this engine's own hashes of the prompt count (a
        mismatch means a different prompt or tokenizer): those are recomputed, as vLLM does
        when a KV load fails.
        """
        bs = self.config.block_size
        try:
            pulled = await (self._kv_puller or self._http_pull)(params)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("KV pull from %s failed (%s); recomputing the prompt",
                        params.get("remote_host"), exc)  # fmt: skip
            return 0
        if pulled is None or pulled.get("block_size") != bs:
            log.warning("KV pull for %s returned nothing usable; recomputing",
                        params.get("remote_request_id"))  # fmt: skip
            return 0
        own = chained_hashes(request.prompt_tokens, bs, request.lora_name)
        matched = 0
        for mine, theirs in zip(own, pulled.get("block_hashes", []), strict=False):
            if mine != theirs:
                break
            matched += 1
        return min(matched * bs, len(request.prompt_tokens) - 1)

    async def _http_pull(self, params: dict[str, Any]) -> dict[str, Any] | None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        url = f"http://{params['remote_host']}:{params['remote_port']}{PULL_PATH}"
        body: dict[str, Any] = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
        timeout = None
        if params.get(BOOTSTRAP_ROOM) is not None:  # the prefill may still be running
            body["wait_s"] = BOOTSTRAP_WAIT_S
            timeout = aiohttp.ClientTimeout(total=BOOTSTRAP_WAIT_S + 10)
        token = self.config.admin_token
        headers = {"Authorization": f"Bearer {token}"} if token else None
        async with self._http.post(url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status == 404:
                return None
            resp.raise_for_status()
            return await resp.json()


def held_to_json(held: HeldBlocks, block_size: int) -> dict[str, Any]:
    return {"block_hashes": held.hashes, "num_tokens": held.num_tokens, "block_size": block_size}
