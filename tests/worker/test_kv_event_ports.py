"""Where KV events listen: the `--kv-events-config` the vLLM launcher gives vLLM, and the default
replay port of `dynamograph worker` with several data parallel ranks.

vLLM is not installed here, so its sockets are stood in for by real ZMQ sockets bound the way
vLLM's `ZmqEventPublisher` binds them (vllm/distributed/kv_events.py, `_socket_setup` and
`offset_endpoint_port`, read in releases 0.9.0 to 0.33.0): the PUB socket is bound only when its
endpoint contains `*` or `::` (or is ipc:// / inproc://) and connected otherwise; the replay
ROUTER is always bound; DP rank r adds r to both ports. A subscriber then connects where the
EPP does: the engine document's endpoints.
"""

import asyncio
import os
import sys

import pytest
import zmq
import zmq.asyncio

from dynamograph.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
    endpoint_for_rank,
)
from dynamograph.protocol.launch import KV_EVENTS_PORT, kv_replay_port
from dynamograph.protocol.ports import bind_ports
from dynamograph.worker import cli as worker_cli
from dynamograph.worker.mock import MockConfig
from dynamograph.worker.testing import free_port, mock_worker, stop_process, wait_for_engine
from dynamograph.worker.vllm import engine_document, kv_events_config

from .conftest import worker_args

pytestmark = pytest.mark.integration


def vllm_binds(endpoint: str) -> bool:
    """vLLM's test for binding rather than connecting its PUB socket (`_socket_setup`)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def on_loopback(endpoint: str) -> str:
    """`*` (every interface, loopback among them) narrowed to 127.0.0.1 for the test's binds."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


def test_vllm_is_told_to_bind_both_endpoints_whatever_the_advertised_host():
    for extra in ((), ("--advertise-host", "10.1.2.3"), ("--advertise-host", "worker.local"),
                  ("--host", "127.0.0.1")):  # fmt: skip
        config = kv_events_config(worker_args("--engine", "vllm", "--kv-events-port", "5600",
                                              *extra))  # fmt: skip
        assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5600", "tcp://*:5601")
        assert vllm_binds(config["endpoint"]), extra
    # the old endpoint, the pod's IP: vLLM would have connected to it, and nobody listens there
    assert not vllm_binds("tcp://10.1.2.3:5557")


async def test_every_rank_vllm_binds_is_reachable_where_the_epp_connects():
    """DP 2 on the default rule (replay after the last events port): vLLM's four sockets bind
    without a clash, and a SUB / DEALER at the document's endpoints reaches each rank."""
    held = bind_ports(4)
    base = held[0].getsockname()[1]
    for sock in held:
        sock.close()
    args = worker_args("--engine", "vllm", "--data-parallel-size", "2",
                       "--kv-events-port", str(base), "--advertise-host", "127.0.0.1")  # fmt: skip
    config = kv_events_config(args)
    document = engine_document(args, "w", "qwen", {})["kv_events"]
    ctx = zmq.asyncio.Context()
    sockets = []  # each rank's, closed at the end (a socket dropped open warns)

    def socket(kind):
        sockets.append(ctx.socket(kind))
        return sockets[-1]

    try:
        for rank in range(2):
            pub = socket(zmq.PUB)
            pub.bind(on_loopback(endpoint_for_rank(config["endpoint"], rank)))
            router = socket(zmq.ROUTER)
            router.bind(on_loopback(endpoint_for_rank(config["replay_endpoint"], rank)))
            sub = socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint_for_rank(document["endpoint"], rank))
            payload = encode_batch(EventBatch(1.0, [AllBlocksCleared()], rank))
            # PUB drops what it sends before the subscription arrives: send until one lands
            for _ in range(200):
                await pub.send_multipart([b"", encode_seq(0), payload])
                if await sub.poll(50):
                    break
            _topic, _seq, got = await sub.recv_multipart()
            assert decode_batch(got).data_parallel_rank == rank
            dealer = socket(zmq.DEALER)
            dealer.connect(endpoint_for_rank(document["replay_endpoint"], rank))
            await dealer.send_multipart([b"", encode_seq(0)])
            client, *request = await asyncio.wait_for(router.recv_multipart(), 10)
            assert request == [b"", encode_seq(0)]
            await router.send_multipart([client, b"", END_SEQ, b""])
            assert await asyncio.wait_for(dealer.recv_multipart(), 10) == [b"", END_SEQ, b""]
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def test_vllm_launch_refuses_what_vllm_cannot_publish_to(capsys):
    assert worker_cli.run(worker_args("--engine", "vllm", "--kv-events-port", "0")) == 2
    assert "mock-only" in capsys.readouterr().err
    assert worker_cli.run(worker_args("--engine", "vllm", "--advertise-host", "fd00::7")) == 2
    assert "IPv4 only" in capsys.readouterr().err


def test_default_replay_port_follows_the_last_ranks_events_port():
    """The operator's rule (`protocol.launch.kv_replay_port`) is the CLI's default."""
    for ranks, replay in ((1, 5558), (2, 5559), (4, 5561)):
        args = worker_args("--data-parallel-size", str(ranks))
        assert worker_cli.replay_port(args) == replay == kv_replay_port(ranks)
        assert worker_cli.kv_ports_problem(args) is None
    assert kv_replay_port(2, KV_EVENTS_PORT) == 5559
    assert worker_cli.replay_port(worker_args("--kv-events-port", "0")) == 0  # free ports


def test_overlapping_explicit_ports_are_refused(capsys):
    args = worker_args("--data-parallel-size", "2", "--kv-replay-port", "5558")
    assert worker_cli.run(args) == 2
    assert "overlap" in capsys.readouterr().err


async def test_a_two_rank_worker_starts_on_default_style_ports():
    """`dynamograph worker --data-parallel-size 2` with an events port and no replay port (the
    default that used to give rank 1's events port to rank 0's replay socket)."""
    held = bind_ports(4)
    base = held[0].getsockname()[1]
    for sock in held:
        sock.close()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamograph.cli", "worker", "--host", "127.0.0.1",
        "--port", str(port), "--data-parallel-size", "2", "--kv-events-port", str(base),
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    ctx = zmq.asyncio.Context()
    try:
        config = await wait_for_engine(f"http://127.0.0.1:{port}", 60, proc)
        assert config.kv_events.endpoint.endswith(f":{base}")
        assert config.kv_events.replay_endpoint.endswith(f":{base + 2}")
        for rank in range(2):
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint_for_rank(config.kv_events.replay_endpoint, rank))
            await dealer.send_multipart([b"", encode_seq(0)])
            assert await asyncio.wait_for(dealer.recv_multipart(), 10) == [b"", END_SEQ, b""]
    finally:
        ctx.destroy(linger=0)
        await stop_process(proc)


async def test_a_mock_config_built_directly_takes_the_same_default_replay_port():
    """`MockConfig` without a replay port (no CLI in between) replays after its last rank's
    events port too: 5558 used to be rank 1's events port with two ranks."""
    assert MockConfig(data_parallel_size=2).replay_port == kv_replay_port(2) == 5559
    held = bind_ports(4)
    base = held[0].getsockname()[1]
    for sock in held:
        sock.close()
    overrides = {"data_parallel_size": 2, "kv_events_port": base, "kv_replay_port": None}
    async with mock_worker(**overrides) as worker:
        assert worker.config.kv_events.endpoint.endswith(f":{base}")
        assert worker.config.kv_events.replay_endpoint.endswith(f":{base + 2}")
