"""vLLM's `kv_transfer_params` hand-off between a prefill and a decode engine.

The prefill leg is a request with `kv_transfer_params: {do_remote_decode: true}` (and
`max_tokens=1`, `stream=false`). The prefill engine computes the prompt, keeps its blocks and
answers with the parameters vLLM's NixlConnector returns: `do_remote_prefill: true`,
`remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`,
`tp_size`. The decode leg carries those parameters; the decode engine pulls the KV (here:
`POST http://remote_host:remote_port/v1/kv_transfer/pull`, which returns the blocks' hashes and
releases them on the prefill side), checks them against its own prompt, and charges a simulated
transfer time instead of recomputing. Blocks whose decode never comes are freed after a timeout
(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, default 480 s).

The bootstrap path (SGLang's; the engine advertises `bootstrap_host`/`bootstrap_port`): both legs
carry a `bootstrap_room`, the prefill holds its blocks under that room's id
(`protocol.engine.bootstrap_request_id`), and the decode leg, sent at once, pulls with `wait_s`:
the pull waits for the prefill to finish instead of answering 404.
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

from dynamograph.protocol.engine import BOOTSTRAP_ROOM, bootstrap_request_id

PULL_PATH = "/v1/kv_transfer/pull"
DEFAULT_TRANSFER_TIMEOUT = 480.0
BOOTSTRAP_WAIT_S = 60.0  # how long a bootstrap pull waits for its prefill to finish


class HandoffError(ValueError):
    pass


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return params is not None and params.get("do_remote_decode") is True


def is_remote_prefill(params: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return params is not None and params.get("do_remote_prefill") is True


def validate_params(params: Any) -> dict[str, Any] | None:
    """Check the shape of a request's `kv_transfer_params`; HandoffError names what is wrong."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise HandoffError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    if is_remote_prefill(params):
        missing = [
            k
            for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
            if params.get(k) in (None, "")
        ]
        if missing:
            raise HandoffError(
                f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)}"
            )
        if not isinstance(params["remote_port"], int):
            raise HandoffError("kv_transfer_params.remote_port must be an integer")
    return params


def hold_key(request_id: str, params: dict[str, Any] | None) -> str:
    """What a prefill holds its blocks under: its bootstrap room's id when the request has one
    (the decode leg pulls by it before the prefill answered), else its request id."""
    room = params.get(BOOTSTRAP_ROOM) if params is not None else None
    return bootstrap_request_id(room) if isinstance(room, int) else request_id


def engine_id(instance_id: int, dp_rank: int) -> str:
    """vLLM names a DP rank's KV engine `<engine id>_dp<rank>`."""
    return f"{instance_id}_dp{dp_rank}"


def response_params(
    *,
    instance_id: int,
    dp_rank: int,
    request_id: str,
    block_ids: list[int],
    host: str,
    port: int,
) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id(instance_id, dp_rank),
        "remote_request_id": request_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


@dataclass(slots=True)
class HeldBlocks:
    blocks: list[int]
    hashes: list[int]
    num_tokens: int
    deadline: float


class PendingTransfers:
    """Blocks a prefill holds for a decode that has not pulled them yet (per rank)."""

    def __init__(self, timeout: float = DEFAULT_TRANSFER_TIMEOUT):
        self.timeout = timeout
        self._held: dict[str, HeldBlocks] = {}
        self._awaited: dict[str, asyncio.Event] = {}  # bootstrap pulls waiting for their prefill

    def hold(self, request_id: str, blocks: list[int], hashes: list[int], num_tokens: int) -> None:
        self._held[request_id] = HeldBlocks(
            blocks, hashes, num_tokens, time.monotonic() + self.timeout
        )
        arrived = self._awaited.pop(request_id, None)
        if arrived is not None:
            arrived.set()

    async def wait(self, request_id: str, wait_s: float) -> bool:
        """Whether blocks are held under `request_id` within `wait_s` seconds."""
        if request_id in self._held:
            return True
        arrived = self._awaited.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(arrived.wait(), wait_s)
        except TimeoutError:
            pass
        finally:  # timed out, or the pull went away (its decode was aborted): forget it
            if self._awaited.get(request_id) is arrived:
                del self._awaited[request_id]
        return request_id in self._held

    def take(self, request_id: str) -> HeldBlocks | None:
        return self._held.pop(request_id, None)

    def expired(self) -> list[HeldBlocks]:
        now = time.monotonic()
        gone = [rid for rid, h in self._held.items() if h.deadline <= now]
        return [self._held.pop(rid) for rid in gone]

    def drain_all(self) -> list[HeldBlocks]:
        held, self._held = list(self._held.values()), {}
        return held

    def __len__(self) -> int:
        return len(self._held)
