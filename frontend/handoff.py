"""The prefill → decode hand-off in vLLM's `kv_transfer_params` form (pure).

The prefill leg is the client's request with `max_tokens=1`, `stream=false` and
`kv_transfer_params {do_remote_decode: true}`; the prefill engine computes the prompt's KV and
answers with the `kv_transfer_params` the decode engine needs to pull it. The decode leg is the
client's request unchanged (its stream flag and limits restored simply by starting again from
the original body) plus those `kv_transfer_params`.

The bootstrap path (SGLang's, as Dynamo's prefill router drives it), for a prefill engine that
advertises `bootstrap_host`/`bootstrap_port` at /v1/engine: both legs carry a random
`bootstrap_room`; the prefill leg runs in the background while the decode leg is sent at once
with transfer parameters naming the bootstrap address, and the decode engine pulls the KV there
once the prefill has it.
"""

import random
from typing import Any

from dynamograph.protocol.engine import BOOTSTRAP_ROOM, EngineConfig, bootstrap_request_id
from dynamograph.protocol.openai import OpenAIError

KV_TRANSFER_PARAMS = "kv_transfer_params"

# What vLLM's disaggregation proxies send on the prefill leg: the engine fills in the rest.
REMOTE_DECODE_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

CLIENT_KV_TRANSFER_PARAMS = (
    f"{KV_TRANSFER_PARAMS} is set by the frontend's prefill→decode hand-off and may not come "
    "from the client (it names the engine to pull KV from); remove it from the request body"
)


class HandoffError(Exception):
    """The prefill leg answered, but not with something the decode leg can use."""


def reject_client_transfer_params(body: dict[str, Any]) -> None:
    """400 for a client-supplied `kv_transfer_params`: it would steer an engine to an address."""
    if KV_TRANSFER_PARAMS in body:
        raise OpenAIError(400, CLIENT_KV_TRANSFER_PARAMS, param=KV_TRANSFER_PARAMS)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, no streaming, KV kept for a remote decode."""
    leg = dict(body)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:  # chat: vLLM prefers it over max_tokens
        leg["max_completion_tokens"] = 1
    leg[KV_TRANSFER_PARAMS] = dict(REMOTE_DECODE_REQUEST)
    return leg


def transfer_params(prefill_response: Any) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill response; HandoffError when absent or malformed."""
    if not isinstance(prefill_response, dict):
        raise HandoffError(
            f"prefill response is not a JSON object: {type(prefill_response).__name__}"
        )
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict) or not params:
        raise HandoffError(
            f"prefill response carries no {KV_TRANSFER_PARAMS} (got {params!r:.80}); is the "
            "prefill engine started with a KV connector (role prefill)?"
        )
    return params


def decode_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's request as sent, plus the prefill's transfer params."""
    leg = dict(body)
    leg[KV_TRANSFER_PARAMS] = params
    return leg


def bootstrap_room() -> int:
    """A fresh room number (a random u63, as SGLang's `bootstrap_room`)."""
    return random.getrandbits(63)


def bootstrap_params(prefill: EngineConfig, dp_rank: int, room: int) -> dict[str, Any] | None:
    """The decode leg's `kv_transfer_params` on the bootstrap path: where and by what to pull
    the prefill's KV before that prefill has answered; None when the prefill engine advertises
    no bootstrap address."""
    if prefill.bootstrap_host is None or prefill.bootstrap_port is None:
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"{prefill.instance_id}_dp{dp_rank}",  # vLLM's name of the rank
        "remote_request_id": bootstrap_request_id(room),
        "remote_block_ids": None,
        "remote_host": prefill.bootstrap_host,
        "remote_port": prefill.bootstrap_port,
        BOOTSTRAP_ROOM: room,
    }
