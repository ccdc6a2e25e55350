"""`dynamograph worker --engine vllm`: exec a real `vllm serve` with the flags the graph needs.

The same contract as the mock: OpenAI on `--port`, KV events over ZMQ (PUB on
`--kv-events-port`, replay ROUTER on `--kv-replay-port`, vLLM adds the DP rank to both), prefix
caching on with the graph's block size, data parallel ranks in one server, and for prefill /
decode roles the NIXL connector for the `kv_transfer_params` hand-off, and `--lora-modules` /
`--max-loras` passed on with `--enable-lora`. vLLM has no `/v1/engine`: the launcher builds our
document from the same flags (`engine_document`; adapters' ids are vLLM's 1, 2, … in
`--lora-modules` order) and vLLM serves it through the `vllm_engine.EngineDocument` middleware.
"""

import argparse
import contextlib
import importlib.util
import ipaddress
import json
import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from dynamograph.protocol.engine import Role
from dynamograph.protocol.identity import default_worker_name, instance_id

from .cli import replay_port
from .lora import LoraModule, adapter_ids
from .vllm_engine import ENV as ENGINE_DOC_ENV
from .vllm_engine import EngineDocument

MIDDLEWARE = f"{EngineDocument.__module__}.{EngineDocument.__qualname__}"


def kv_events_config(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's KV-event publisher, listening where the EPP connects (the engine document's
    endpoints, on the advertised host).

    vLLM's `ZmqEventPublisher._socket_setup` (vllm/distributed/kv_events.py; the releases
    checked, 0.9.0 to 0.33.0, agree) BINDS the PUB endpoint only when it contains `*` or `::`
    or is ipc:// / inproc://, and CONNECTS to any other: `tcp://<pod IP>:5557` would dial out
    to nobody. So both endpoints are `tcp://*:PORT` (the replay ROUTER, always bound, alike:
    one rule), every interface of the pod. Each DP rank adds its rank to both ports
    (`offset_endpoint_port`), as `endpoint_for_rank` reads them. vLLM sets no IPV6 option on
    these sockets: they listen on IPv4 only (`launch_problems` refuses an IPv6 advertise
    address)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{args.kv_events_port}",
        "replay_endpoint": f"tcp://*:{replay_port(args)}",
        "topic": args.kv_events_topic,
    }


def launch_problems(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """Why vLLM's KV events could not reach the EPP with these flags (empty: they can)."""
    problems = []
    if 0 in (args.kv_events_port, replay_port(args)):
        problems.append("--kv-events-port / --kv-replay-port 0 (free ports) are mock-only: "
                        "the engine document must name the ports vLLM binds")  # fmt: skip
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(_advertised_host(args, env)).version == 6:
            problems.append("vLLM's KV-event sockets listen on IPv4 only (no IPV6 socket "
                            "option): give an IPv4 --advertise-host")  # fmt: skip
    return problems


def kv_transfer_config(role: Role) -> dict[str, Any] | None:
    """NIXL both ways on the prefill and decode sides (vLLM's disaggregated-serving recipe)."""
    if role is Role.AGGREGATED:
        return None
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def vllm_argv(args: argparse.Namespace) -> list[str]:
    role = Role(args.role)
    argv = [
        "vllm", "serve", args.model,
        "--host", args.host,
        "--port", str(args.port),
        "--served-model-name", args.served_model_name or args.model,
        "--block-size", str(args.block_size),
        "--enable-prefix-caching",
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.context_length),
        "--data-parallel-size", str(args.data_parallel_size),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--pipeline-parallel-size", str(args.pipeline_parallel_size),
        "--seed", str(args.seed),
        "--scheduling-policy", args.scheduling_policy,
        "--kv-events-config", json.dumps(kv_events_config(args), separators=(",", ":")),
        "--middleware", MIDDLEWARE,
    ]  # fmt: skip
    if args.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(args.num_gpu_blocks)]
    if args.tokenizer and os.path.exists(args.tokenizer):
        argv += ["--tokenizer", args.tokenizer]
    transfer = kv_transfer_config(role)
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if args.lora_modules:
        argv += ["--enable-lora", "--max-loras", str(args.max_loras), "--lora-modules",
                 *map(lora_module_arg, args.lora_modules)]  # fmt: skip
    return argv + list(args.vllm_arg)


def lora_module_arg(module: LoraModule) -> str:
    """vLLM's `--lora-modules` item: NAME=PATH, or JSON when a base model is named."""
    if module.base_model_name is None and "," not in module.path and "=" not in module.path:
        return f"{module.name}={module.path}"
    fields = {"name": module.name, "path": module.path}
    if module.base_model_name is not None:
        fields["base_model_name"] = module.base_model_name
    return json.dumps(fields, separators=(",", ":"))


def engine_document(
    args: argparse.Namespace, name: str, tokenizer: str, env: dict[str, str]
) -> dict[str, Any]:
    """Our `/v1/engine` document for this vLLM server (`total_kv_blocks` None when vLLM sizes
    its cache itself: the middleware fills it in from the running server)."""
    role = Role(args.role)
    advertise = _advertised_host(args, env)
    return {
        "model": args.model,
        "served_model_name": args.served_model_name or args.model,
        "context_length": args.context_length,
        "kv_cache_block_size": args.block_size,
        "total_kv_blocks": args.num_gpu_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # no bootstrap address: vLLM's NIXL hand-off needs the block ids of the prefill's
        # answer, so its decode leg cannot start first (the bootstrap path is SGLang's)
        "bootstrap_host": None,
        "bootstrap_port": None,
        "instance_id": instance_id(name),
        "name": name,
        "role": role.value,
        "data_parallel_size": args.data_parallel_size,
        "tokenizer": tokenizer,
        "kv_events": {
            "endpoint": f"tcp://{advertise}:{args.kv_events_port}",
            "replay_endpoint": f"tcp://{advertise}:{replay_port(args)}",
            "topic": kv_events_config(args)["topic"],
        },
        "engine": "vllm",
        "lora_adapters": adapter_ids(args.lora_modules or []),
    }


def _advertised_host(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """Where other pods reach this one (KV events, the NIXL side channel)."""
    return args.advertise_host or env.get("POD_IP") or args.host


def vllm_env(
    args: argparse.Namespace, document: dict[str, Any], base: dict[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[ENGINE_DOC_ENV] = json.dumps(document, separators=(",", ":"))
    if Role(args.role) is not Role.AGGREGATED:
        # The NIXL side channel must be reachable by the other side of the hand-off.
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", _advertised_host(args, env))
    return env


def missing() -> list[str]:
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(f"the `vllm` Python package is not importable by {sys.executable}")
    if shutil.which("vllm") is None:
        problems.append("no `vllm` executable on PATH")
    return problems


def run_vllm(args: argparse.Namespace) -> int:
    problems = launch_problems(args, os.environ)
    if problems:
        print("dynamograph worker --engine vllm: " + "; ".join(problems), file=sys.stderr)
        return 2
    problems = missing()
    if problems:
        print(
            "dynamograph worker --engine vllm: cannot launch vLLM: "
            + "; ".join(problems)
            + ". Install it (`pip install vllm`, needs a CUDA GPU) in this environment, "
            "or use `--engine mock` for the simulated engine.",
            file=sys.stderr,
        )
        return 2
    from dynamograph.protocol.tokenization import get_tokenizer, tokenizer_for_model

    name = args.name or default_worker_name()
    try:
        spec = args.tokenizer or tokenizer_for_model(args.model)  # never guessed for others
        tokenizer = get_tokenizer(spec).identity
    except (OSError, ValueError) as exc:
        print(f"dynamograph worker --engine vllm: tokenizer: {exc}", file=sys.stderr)
        return 2
    document = engine_document(args, name, tokenizer, dict(os.environ))
    argv = vllm_argv(args)
    os.execvpe(argv[0], argv, vllm_env(args, document))
    return 0  # not reached
