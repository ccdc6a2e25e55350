"""The tokenizers workers publish, loaded off the event loop before their first request.

`TokenizerLoads` starts a load of a worker's tokenizer as the worker appears (one at a time
per tokenizer), so no request waits seconds for a vocabulary. A tokenizer that cannot be
loaded (a path this process cannot read, a vocabulary dynamograph does not ship) would fail
every request routed to its workers, so they are held out of routing (not ready: the `ready`
filter passes over them) and the load is tried again every `RETRY_S` (a volume mounted
later); once it loads they are routed again.
"""

import asyncio
import logging
from collections.abc import Callable

from .scheduler import Router
from .tasks import cancel_all

log = logging.getLogger(__name__)

RETRY_S = 10.0  # a tokenizer that failed to load is tried again this often


class TokenizerLoads:
    def __init__(
        self,
        router: Router,
        load: Callable[[str], object],
        *,
        on_change: Callable[[], None] = lambda: None,
        on_failure: Callable[[str], None] = lambda spec: None,
    ):
        self.router = router
        self._load = load
        self.on_change = on_change  # a first load ended, or workers were held or released
        self.on_failure = on_failure  # every failed load, by tokenizer spec
        self.loading: set[str] = set()  # tokenizers whose first load is under way
        self.held: dict[str, set[int]] = {}  # workers held out of routing, by their tokenizer
        self._workers: dict[int, str] = {}  # the tokenizer each worker publishes
        self._tasks: set[asyncio.Task[None]] = set()

    def added(self, worker_id: int, spec: str) -> None:
        self._workers[worker_id] = spec
        if spec in self.held:  # it failed already: the worker waits with the others
            self.held[spec].add(worker_id)
            self.router.set_ready(worker_id, False)
        elif spec not in self.loading:
            self.loading.add(spec)
            task = asyncio.get_running_loop().create_task(self._run(spec), name=f"load {spec}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def removed(self, worker_id: int) -> None:
        spec = self._workers.pop(worker_id, None)
        if spec is not None:
            self.held.get(spec, set()).discard(worker_id)

    def held_workers(self) -> set[int]:
        return set().union(*self.held.values())

    async def _run(self, spec: str) -> None:
        while True:
            try:
                await asyncio.to_thread(self._load, spec)
            except Exception as exc:
                self.on_failure(spec)
                if spec not in self.held:
                    log.error(
                        "tokenizer %r cannot be loaded: %s; its workers are not routed to until "
                        "it can (retried every %g s)",
                        spec,
                        exc,
                        RETRY_S,
                        exc_info=not isinstance(exc, OSError | ValueError),  # a bug: say where
                    )
                    self._hold(spec)
            else:
                self._release(spec)
                return
            finally:
                self.loading.discard(spec)
                self.on_change()
            await asyncio.sleep(RETRY_S)

    def _hold(self, spec: str) -> None:
        held = self.held.setdefault(spec, set())
        for worker, published in self._workers.items():
            if published == spec and worker not in held:
                held.add(worker)
                self.router.set_ready(worker, False)

    def _release(self, spec: str) -> None:
        held = self.held.pop(spec, None)
        if not held:
            return
        log.info("tokenizer %r loaded: its workers are routed to again", spec)
        for worker in held:
            if self._workers.get(worker) == spec:
                self.router.set_ready(worker, True)

    async def close(self) -> None:
        await cancel_all(list(self._tasks))
