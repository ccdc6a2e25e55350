"""`dynamograph worker`: run the simulated GPU engine (`--engine mock`) or launch vLLM.

The command line is the cross-component contract (docs/contracts.md): the operator writes it
into pod specs and `dynamograph up` runs it locally.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from dynamograph.protocol.engine import Role
from dynamograph.protocol.identity import default_worker_name
from dynamograph.protocol.kv_curve import add_kv_curve_argument, kv_curve_from_args
from dynamograph.protocol.kv_events import ARRAY, LAYOUTS
from dynamograph.protocol.launch import ADMIN_TOKEN_ENV, kv_replay_port
from dynamograph.protocol.tokenization import tokenizer_for_model

from .cost import CostModel
from .handoff import DEFAULT_TRANSFER_TIMEOUT
from .http_limits import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_BODY_BYTES
from .lora import parse_lora_module

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument(
        "--engine",
        choices=["mock", "vllm"],
        default="mock",
        help="mock: the simulated GPU engine; vllm: exec `vllm serve` (default: mock)",
    )
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model name or path")
    p.add_argument(
        "--served-model-name", default=None, help="name clients put in `model` (default: --model)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer spec: qwen, qwen:<vocabulary> or a tokenizer.json path (default: a Qwen "
        "model's vocabulary; the mock simulates any model with the embedded one; --engine vllm "
        "with another model needs it)",
    )
    p.add_argument(
        "--fast-tokenizer",
        action="store_true",
        help="mock: build the fast BPE encoder (fastokens) before serving, ~1.5 s of CPU and "
        "~100 MB, instead of once the process has spent about that encoding with the "
        "reference (for long prompts at a steady rate from the first request, e.g. benchmarks)",
    )
    p.add_argument("--role", choices=[r.value for r in Role], default=Role.AGGREGATED.value)
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve, as vLLM takes them: NAME=PATH or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; clients select one with '
        "`model`; the mock only records the path",
    )
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="mock prefill: advertise a bootstrap address, so the decode leg starts at once and "
        "pulls the KV when the prefill has it (SGLang's hand-off; vLLM's NIXL has none)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("priority", "fcfs"),
        default="priority",
        help="vLLM's --scheduling-policy: priority (default here: the frontend forwards "
        "agent_hints.priority as the request's priority) or fcfs (vLLM's default: a request "
        "with a non-zero priority is refused)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="distinct LoRA adapters in one batch (vLLM's --max-loras, default 1)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="instance name the instance id derives from (default: $POD_NAME, else hostname)",
    )
    p.add_argument("--host", default="0.0.0.0", help="bind address (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port, 0 = any free port")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="address others reach this worker at (default: $POD_IP, else --host)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_TOKEN_ENV) or None,
        help=f"bearer token the admin endpoints (/v1/kv_transfer/pull, /reset_prefix_cache, "
        f"/debug/requests) require, shared by a graph's workers (default: ${ADMIN_TOKEN_ENV}; "
        "prefer the variable: a flag shows in the process list)",
    )
    p.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="without an admin token, serve /debug/requests and /reset_prefix_cache anyway "
        "(off by default)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest request body, else 413 (default {MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds a client has to send a request head, from its first byte, else 408 "
        f"(default {HEAD_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help="seconds a client has to send a request body, from the end of its head, else 408 "
        f"(default {BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=5557,
        help="ZMQ PUB port of DP rank 0; rank r uses port + r (0 = free ports)",
    )
    p.add_argument(
        "--kv-replay-port",
        type=int,
        default=None,
        help="ZMQ ROUTER replay port of DP rank 0; rank r uses port + r (default: the port "
        "after the last rank's events port, 5558 for one rank; 0 when --kv-events-port is 0)",
    )
    add_kv_curve_argument(p)
    p.add_argument(
        "--kv-events-layout",
        choices=LAYOUTS,
        default=ARRAY,
        help="mock: KV event encoding: array (vLLM 0.9-0.23), map (events as tagged maps, vLLM "
        "0.24-0.33) or map-batch (the batch a map too, as vLLM's source has it at one commit; "
        "no release); default array",
    )
    p.add_argument(
        "--kv-events-topic",
        default="",
        help="the topic frame every KV event batch carries (vLLM's kv_events_config topic; "
        "llm-d's precise prefix-cache scorer reads kv@<pod>@<model>); default empty",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV cache blocks per rank (mock default 8192; vllm sizes it from GPU memory)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--context-length", type=int, default=32768, help="max model length")
    p.add_argument("--data-parallel-size", type=int, default=1, help="DP ranks in this process")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vllm: GPUs each rank shards the model over (the mock simulates one device)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="vllm: pipeline stages per rank (the mock simulates one device)",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="mock: run simulated time this many times faster than real time",
    )
    p.add_argument("--seed", type=int, default=0, help="mock: seed of the output tokens")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=128,
        help="mock: output length when a request sets no max_tokens",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=DEFAULT_TRANSFER_TIMEOUT,
        help="mock prefill: seconds to hold blocks for a decode that never pulls them",
    )
    cost = CostModel()
    p.add_argument(
        "--cost-overhead-ms",
        type=float,
        default=cost.overhead_s * 1e3,
        help="mock cost model: fixed per-step overhead",
    )
    p.add_argument(
        "--cost-weights-ms",
        type=float,
        default=cost.weights_read_s * 1e3,
        help="mock cost model: time to stream the weights once (decode step floor)",
    )
    p.add_argument(
        "--cost-token-us",
        type=float,
        default=cost.compute_per_token_s * 1e6,
        help="mock cost model: compute per scheduled token",
    )
    p.add_argument(
        "--cost-kv-read-ns",
        type=float,
        default=cost.kv_read_per_token_s * 1e9,
        help="mock cost model: KV read per context token per decode step",
    )
    p.add_argument(
        "--kv-transfer-gbps",
        type=float,
        default=cost.kv_transfer_bandwidth / 1e9,
        help="mock cost model: prefill→decode KV link bandwidth, GB/s",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="vllm: extra argument passed through to `vllm serve` (repeatable)",
    )


def _cost_model(args: argparse.Namespace) -> CostModel:
    return CostModel(
        overhead_s=args.cost_overhead_ms / 1e3,
        weights_read_s=args.cost_weights_ms / 1e3,
        compute_per_token_s=args.cost_token_us / 1e6,
        kv_read_per_token_s=args.cost_kv_read_ns / 1e9,
        kv_transfer_bandwidth=args.kv_transfer_gbps * 1e9,
    )


def mock_config(args: argparse.Namespace):
    from .mock import MockConfig

    return MockConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer or tokenizer_for_model(args.model, simulated=True),
        fast_tokenizer=args.fast_tokenizer,
        role=Role(args.role),
        name=args.name or default_worker_name(),
        host=args.host,
        advertise_host=args.advertise_host or os.environ.get("POD_IP") or None,
        port=args.port,
        kv_events_port=args.kv_events_port,
        kv_replay_port=replay_port(args),
        kv_events_layout=args.kv_events_layout,
        kv_events_topic=args.kv_events_topic,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks or 8192,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        context_length=args.context_length,
        data_parallel_size=args.data_parallel_size,
        speedup=args.speedup,
        seed=args.seed,
        default_max_tokens=args.default_max_tokens,
        transfer_timeout=args.kv_transfer_timeout,
        cost=_cost_model(args),
        lora_modules=list(args.lora_modules),
        max_loras=args.max_loras,
        scheduling_policy=args.scheduling_policy,
        bootstrap=args.bootstrap,
        admin_token=args.admin_token,
        debug_endpoints=args.debug_endpoints,
        kv_curve=kv_curve_from_args(args),
    )


def replay_port(args: argparse.Namespace) -> int:
    """--kv-replay-port, else the operator's rule (`protocol.launch.kv_replay_port`)."""
    if args.kv_replay_port is not None:
        return int(args.kv_replay_port)
    return kv_replay_port(args.data_parallel_size, args.kv_events_port)


def kv_ports_problem(args: argparse.Namespace) -> str | None:
    """Events and replay ports that some two ranks would share (each rank adds its rank)."""
    events, replay, ranks = args.kv_events_port, replay_port(args), args.data_parallel_size
    if 0 in (events, replay) or abs(events - replay) >= ranks:
        return None
    return (f"--kv-events-port {events} and --kv-replay-port {replay} overlap with "
            f"{ranks} data parallel ranks (rank r uses port + r on both)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    problem = kv_ports_problem(args)
    if problem is not None:
        print(f"dynamograph worker: {problem}", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        if args.kv_curve_dir:
            print(
                "dynamograph worker: --kv-curve-dir needs --engine mock: vLLM's KV-event "
                "publisher has no CURVE option",
                file=sys.stderr,
            )
            return 2
        from .vllm import run_vllm

        return run_vllm(args)
    if (args.tensor_parallel_size, args.pipeline_parallel_size) != (1, 1):
        print(
            "dynamograph worker: --tensor-parallel-size and --pipeline-parallel-size are vllm "
            "settings; the mock engine simulates one device per rank",
            file=sys.stderr,
        )
        return 2
    try:
        config = mock_config(args)
        config.validate()
    except ValueError as exc:
        print(f"dynamograph worker: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(_serve(config, args))


async def _serve(config, args: argparse.Namespace) -> int:
    from .mock import MockEngine
    from .server import WorkerServer

    server = WorkerServer(
        MockEngine(config),
        host=config.host,
        port=config.port,
        max_body_bytes=args.max_body_bytes,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
    )
    try:
        engine = await server.start(config.name)
    except OSError as exc:
        print(f"dynamograph worker: cannot start: {exc}", file=sys.stderr)
        return 1
    log.info("mock worker %s (instance %d, %s) serving %s on %s, KV events %s",
             engine.name, engine.instance_id, engine.role, engine.served_model_name,
             server.url, engine.kv_events)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.engine.drain(grace=5.0)
    await server.stop()
    return 0
