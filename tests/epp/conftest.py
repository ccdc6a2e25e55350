"""Shared fixtures and helpers for the EPP tests: real mock workers, a real EPP (or two with
replica sync), an ext_proc client speaking with Envoy's message sequences (xds-protos types),
and a real Envoy; for TLS, a folder laid out like a mounted TLS Secret."""

import asyncio
import contextlib
from collections.abc import Iterable
from pathlib import Path

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from dynamograph.epp.server import Epp, EppSettings
from dynamograph.epp.tls import KeyPair
from dynamograph.local.procs import PortPool
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.protocol.tokenization import get_tokenizer
from dynamograph.router.discovery import StaticSource, WorkerTarget
from dynamograph.router.replicas import ReplicaSettings
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

MODEL = "Qwen/Qwen3-0.6B"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def endpoint_of(worker) -> str:
    return worker.url.removeprefix("http://")


# ---- Envoy's messages ---------------------------------------------------------------------


NO_PROTOCOL_CONFIG = pb.ProtocolConfiguration()  # marker: send the first message without one


def protocol_config(
    request_mode=FULL_DUPLEX, response_mode=FULL_DUPLEX, without_waiting=False
) -> pb.ProtocolConfiguration:
    """As Envoy 1.40 sends it for the filter's processing_mode. The gateways leave
    send_body_without_waiting_for_header_response unset (false)."""
    return pb.ProtocolConfiguration(
        request_body_mode=request_mode,
        response_body_mode=response_mode,
        send_body_without_waiting_for_header_response=without_waiting,
    )


def request_headers(
    path="/v1/chat/completions",
    method="POST",
    extra: Iterable[tuple[str, str]] = (),
    *,
    end_of_stream=False,
    content_length: int | None = None,
    subset: list[str] | str | None = None,
    config: pb.ProtocolConfiguration | None = None,
) -> pb.ProcessingRequest:
    """The first message as Envoy 1.40 sends it: protocol_config, values in raw_value only.
    `config=NO_PROTOCOL_CONFIG` leaves protocol_config out, as Envoys before 1.33 do."""
    pairs = [
        (":authority", "gateway.local"),
        (":path", path),
        (":method", method),
        (":scheme", "http"),
        *extra,
    ]
    if content_length is not None:
        pairs += [("content-length", str(content_length)), ("content-type", "application/json")]
    pairs += [("x-forwarded-proto", "http"), ("x-request-id", "rid-" + path)]
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=end_of_stream,
        ),
    )
    if config is not NO_PROTOCOL_CONFIG:
        message.protocol_config.CopyFrom(config or protocol_config())
    if subset is not None:
        fields = message.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields
        value = fields["x-gateway-destination-endpoint-subset"]
        if isinstance(subset, str):
            value.string_value = subset
        else:
            value.list_value.SetInParent()
            value.list_value.values.extend([])
            for item in subset:
                value.list_value.values.add().string_value = item
    return message


def body_messages(body: bytes, chunk: int = 65536, *, trailing_empty=True):
    """Body chunks as Envoy forwards them; with a Content-Length body Envoy ends with an empty
    end_of_stream chunk."""
    messages = [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body[i : i + chunk]))
        for i in range(0, len(body), chunk)
    ]
    if trailing_empty or not messages:
        messages.append(pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)))
    else:
        messages[-1].request_body.end_of_stream = True
    return messages


def response_headers(status=200, content_type="text/event-stream", served: str | None = None):
    pairs = [(":status", str(status)), ("content-type", content_type)]
    if served:
        pairs.append(("x-gateway-destination-endpoint-served", served))
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            )
        )
    )


def response_body(data: bytes, end_of_stream=False):
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def chat_body(content: str, model=MODEL, **extra) -> bytes:
    return orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    )


def set_headers(response: pb.ProcessingResponse) -> dict[str, str]:
    mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def removed_headers(response: pb.ProcessingResponse) -> list[str]:
    return list(response.request_headers.response.header_mutation.remove_headers)


def lb_metadata(response: pb.ProcessingResponse) -> dict:
    fields = response.dynamic_metadata.fields
    return {
        ns: {k: v.string_value for k, v in fields[ns].struct_value.fields.items()} for ns in fields
    }


class ExtProcStream:
    """One ext_proc stream to the EPP, as Envoy drives it."""

    def __init__(self, call):
        self.call = call

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def recv(self, within: float = 10.0) -> pb.ProcessingResponse:
        async with asyncio.timeout(within):
            response = await self.call.read()
        assert response is not grpc.aio.EOF, "EPP closed the stream"
        return response

    async def recv_n(self, n: int) -> list[pb.ProcessingResponse]:
        return [await self.recv() for _ in range(n)]

    async def request(
        self, body: bytes, path="/v1/chat/completions", extra=(), subset=None, chunk=65536
    ) -> tuple[pb.ProcessingResponse, bytes, list[pb.ProcessingResponse]]:
        """Headers + body; returns (headers response, re-streamed body, body responses)."""
        messages = [
            request_headers(path, extra=extra, content_length=len(body), subset=subset),
            *body_messages(body, chunk),
        ]
        # Like Envoy, stop sending once the EPP answered early (an ImmediateResponse ends it).
        reader = asyncio.create_task(self.recv())
        for message in messages:
            if reader.done():
                break
            try:
                await self.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
        first = await reader
        if first.HasField("immediate_response"):
            return first, b"", []
        chunks = []
        while True:
            response = await self.recv()
            chunks.append(response)
            if response.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
        data = b"".join(
            r.request_body.response.body_mutation.streamed_response.body for r in chunks
        )
        return first, data, chunks

    async def finish_response(self, chunks=(b'data: {"x": 1}\n\n', b"data: [DONE]\n\n")):
        await self.send(response_headers())
        ack = await self.recv()
        assert ack.HasField("response_headers")
        echoed = []
        for i, data in enumerate(chunks):
            await self.send(response_body(data, end_of_stream=i == len(chunks) - 1))
            echoed.append(await self.recv())
        return echoed


class ExtProcClient:
    """A channel to the EPP's ext_proc port: plaintext, or TLS trusting `root_pem` (a served
    self-signed certificate, or the CA that signed the served one) for the name `localhost`."""

    def __init__(self, port: int, root_pem: bytes | None = None):
        target = f"127.0.0.1:{port}"
        if root_pem is None:
            self.channel = grpc.aio.insecure_channel(target)
        else:
            self.channel = grpc.aio.secure_channel(
                target,
                grpc.ssl_channel_credentials(root_certificates=root_pem),
                # Own subchannels: a new client makes a new connection (a new handshake)
                # instead of sharing another channel's under gRPC's global subchannel pool.
                options=[
                    ("grpc.ssl_target_name_override", "localhost"),
                    ("grpc.use_local_subchannel_pool", 1),
                ],
            )
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def stream(self) -> ExtProcStream:
        return ExtProcStream(self.stub.Process())

    async def close(self):
        await self.channel.close()


def record_picks(epp) -> list[int]:
    """The worker id of every request the EPP routes from now on, in order (the picker wrapped)."""
    picks: list[int] = []
    picker = epp.service.picker
    original = picker.pick

    async def recording_pick(path, headers, body, subset):
        route = await original(path, headers, body, subset)
        picks.append(route.worker_id)
        return route

    picker.pick = recording_pick
    return picks


# ---- fixtures -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_epp(workers, *, serving: dict[str, str] | None = None, **settings):
    """A real EPP on free ports in this loop, with the given workers discovered statically.
    `serving` overrides the endpoint a worker (by URL) is routed to, e.g. one nothing answers."""
    router = settings.pop("router", RouterConfig())
    serving = serving or {}
    targets = [
        WorkerTarget(
            w.url,
            w.url,
            serving.get(w.url, endpoint_of(w)) if w.config.role.value != "prefill" else None,
        )
        for w in workers
    ]
    epp = Epp(
        EppSettings(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            metrics_port=0,
            router=router,
            scrape_interval=0.1,
            drain_grace=1.0,
            **settings,
        ),
        StaticSource(targets),
    )
    await epp.start()
    try:
        ids = {w.config.instance_id for w in workers}
        await wait_for(
            lambda: ids <= set(epp.router.workers()), "the EPP to know every worker", within=20
        )
        # The EPP preloads each worker's tokenizer in a thread; a request arriving meanwhile
        # waits for it on the event loop (seconds, the first time in a process). Tests about
        # anything else start once it is loaded.
        for spec in {w.config.tokenizer for w in workers}:
            with contextlib.suppress(OSError, ValueError):  # one it cannot load: the test's case
                await asyncio.to_thread(get_tokenizer, spec, fast=True)
        if epp.kv is not None:  # every subscriber has caught up with its worker once
            await wait_for(
                lambda: all(s.replays > 0 for subs in epp.kv.subscribers.values() for s in subs),
                "every KV-event subscriber to have replayed once",
                within=20,
            )
        yield epp
    finally:
        await epp.stop()


@contextlib.asynccontextmanager
async def two_replicas(workers):
    """Two real EPPs with replica sync to each other (heartbeats every 0.2 s), once they have
    met. Each one's 127.0.0.1 replica port is held until just before it binds it: B's stays
    taken while A starts."""
    pools = {name: PortPool() for name in "ab"}
    port = {name: pool.take() for name, pool in pools.items()}

    @contextlib.asynccontextmanager
    async def replica(own: str, peer: str):
        pools[own].release()
        peers = [f"tcp://127.0.0.1:{port[peer]}"]
        settings = ReplicaSettings(
            f"tcp://127.0.0.1:{port[own]}", peers, heartbeat_s=0.2, timeout_s=5.0
        )
        async with running_epp(workers, replicas=settings) as epp:
            yield epp

    try:
        async with replica("a", "b") as a, replica("b", "a") as b:
            await wait_for(
                lambda: a.replicas.live_peers() and b.replicas.live_peers(), "the replicas to meet"
            )
            yield a, b
    finally:
        for pool in pools.values():
            pool.release()


@pytest.fixture
async def workers():
    async with (
        mock_worker(model=MODEL, name="epp-test-a") as a,
        mock_worker(model=MODEL, name="epp-test-b") as b,
    ):
        yield [a, b]


@pytest.fixture
async def epp(workers):
    async with running_epp(workers) as epp:
        yield epp


@pytest.fixture
async def client(epp):
    client = ExtProcClient(epp.grpc_port)
    yield client
    await client.close()


# ---- TLS ----------------------------------------------------------------------------------


class SecretVolume:
    """A folder laid out like a mounted kubernetes.io/tls Secret: `tls.crt` and `tls.key` are
    symlinks through `..data`, which the kubelet swaps atomically to a new timestamped folder
    when the Secret changes (what cert-manager's rotation looks like to the EPP)."""

    def __init__(self, root: Path):
        self.root = root
        self.generation = 0
        root.mkdir(parents=True, exist_ok=True)

    def publish(self, pair: KeyPair) -> None:
        self.generation += 1
        version = self.root / f"..2026_01_01_00_00_{self.generation:02d}.000"
        version.mkdir()
        (version / "tls.crt").write_bytes(pair.certificate_chain)
        (version / "tls.key").write_bytes(pair.private_key)
        staging = self.root / "..data_tmp"
        staging.symlink_to(version.name)
        staging.replace(self.root / "..data")  # rename(2): atomic, like the kubelet
        for name in ("tls.crt", "tls.key"):
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
