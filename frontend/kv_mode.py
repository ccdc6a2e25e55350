"""`--mode kv`: the frontend picks workers with the router core itself (no gateway in front).

For users without an Envoy gateway and endpoint picker: the frontend runs the EPP's router core
(`epp.scheduler.Router`) fed by the same discovery, the EPP's load scraper (`epp.load`) and,
unless `--kv-events off`, the EPP's KV-event subscribers (`epp.kv_events`). Each request is
tokenized with the workers' tokenizer, hashed per KV block and scheduled; the booking is
released when the request ends. As in the EPP, a `model` naming a LoRA adapter
(`protocol.engine.served_models`) is hashed under the adapter and goes only to workers serving
it; a model nobody serves is a 404.
"""

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from dynamograph.protocol.engine import lora_for_model, served_models
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.nvext import NvExt
from dynamograph.protocol.openai import OpenAIError, require_model
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.kv_events import KvEventIngest
from dynamograph.router.load import LoadScraper
from dynamograph.router.scheduler import (
    NoEligibleWorker,
    Overloaded,
    Router,
    RouteRequest,
)

from .directory import WorkerDirectory
from .pickers import Route
from .routing import Mode, Pins, Target

log = logging.getLogger(__name__)


class KvPicker:
    mode = Mode.KV

    def __init__(
        self,
        directory: WorkerDirectory,
        *,
        enforce_disagg: bool,
        kv_events: bool,
        config: RouterConfig | None = None,
    ):
        self.directory = directory
        base = config or RouterConfig()
        # The frontend's own flags can only tighten what the router config file says.
        self.config = base.model_copy(
            update={
                "enforce_disagg": enforce_disagg or base.enforce_disagg,
                "use_kv_events": kv_events and base.use_kv_events,
            }
        )
        self.router = Router(self.config)
        self._ids = itertools.count()
        self.load: LoadScraper | None = None
        self.events: KvEventIngest | None = None
        self._preloads: set[asyncio.Task] = set()

    async def start(self) -> None:
        # Created here: they bind to the running event loop.
        self.load = LoadScraper(self.router, on_unreachable=self.directory.mark_unreachable)
        if self.config.use_kv_events:
            self.events = KvEventIngest(self.router, on_disconnect=self.load.probe_now)
        self.directory.add_listener(self._added, self._removed)

    async def stop(self) -> None:
        for task in self._preloads:
            task.cancel()
        if self.events is not None:
            await self.events.close()
            self.events = None
        if self.load is not None:
            await self.load.close()
            self.load = None

    def _added(self, record: WorkerRecord) -> None:
        if not self.router.add_engine(record.config):
            return
        if self.load is not None:
            self.load.add(record)
        if self.events is not None:
            self.events.add(record)
        # Off the event loop, so no request waits seconds for a vocabulary to load.
        task = asyncio.get_running_loop().create_task(self._preload(record.config.tokenizer))
        self._preloads.add(task)
        task.add_done_callback(self._preloads.discard)

    @staticmethod
    async def _preload(spec: str) -> None:
        try:
            await asyncio.to_thread(get_tokenizer, spec, fast=True)
        except (OSError, ValueError) as exc:  # requests meet the same error
            log.error("tokenizer %r of a worker cannot be loaded: %s", spec, exc)

    def _removed(self, record: WorkerRecord) -> None:
        if self.directory.get(record.instance_id) is not None:
            return  # still known through the other discovery (local engine and graph)
        if self.load is not None:
            self.load.remove(record)
        if self.events is not None:
            self.events.remove(record)
        with contextlib.suppress(KeyError):
            self.router.remove_worker(record.instance_id)

    def _tokens(self, path: str, body: dict[str, Any]):
        """The request's tokens and the LoRA adapter its `model` names (None: the base model)."""
        records = self.directory.records()
        if not records:
            raise OpenAIError(503, "no workers are discovered yet")
        lora_name = lora_for_model(require_model(body), served_models(r.config for r in records))
        tokens = request_tokens(get_tokenizer(records[0].config.tokenizer, fast=True), path, body)
        return tokens, lora_name

    async def pick(self, pins: Pins, nvext: NvExt | None, path: str, body: dict[str, Any]) -> Route:
        block_size = self.router.block_size
        if block_size is None:
            raise OpenAIError(503, "no workers are discovered yet")
        tokens, lora_name = self._tokens(path, body)
        osl = nvext.agent_hints.osl if nvext and nvext.agent_hints else None
        request = RouteRequest(
            request_id=f"frontend-{next(self._ids)}",
            block_hashes=block_hash_array(tokens, block_size, lora_name),
            isl_tokens=len(tokens),
            lora_name=lora_name,
            pins=RoutePins(
                pins.decode.worker_id if pins.decode else None,
                pins.decode.dp_rank if pins.decode else None,
                pins.prefill.worker_id if pins.prefill else None,
                pins.prefill.dp_rank if pins.prefill else None,
            ),
            session=nvext.session_control if nvext else None,
            expected_output_tokens=osl,
        )
        try:
            decision = self.router.schedule(request)
        except NoEligibleWorker as exc:
            raise OpenAIError(503, exc.reason) from None
        except Overloaded as exc:
            error = OpenAIError(429, f"{exc.reason}; retry after {exc.retry_after_s:g} s")
            error.retry_after = exc.retry_after_s  # becomes the Retry-After header
            raise error from None
        try:
            decode = _target(decision.decode.worker_id, decision.decode.dp_rank, self.directory)
            route = Route(self.directory.resolve(decode, "decode"), decode, booking=decision.guard)
            if decision.prefill is not None:
                prefill = _target(
                    decision.prefill.worker_id, decision.prefill.dp_rank, self.directory
                )
                route.prefill = self.directory.resolve(prefill, "prefill")
                route.prefill_target = prefill
        except OpenAIError:
            if decision.guard is not None:
                decision.guard.free()
            raise
        return route


def _target(worker_id: int, dp_rank: int, directory: WorkerDirectory) -> Target:
    """Send the DP rank header only to data-parallel engines."""
    record = directory.get(worker_id)
    multi = record is not None and record.config.data_parallel_size > 1
    return Target(worker_id, dp_rank if multi else None)
