"""The EPP serving ext_proc over TLS on 127.0.0.1, seen by grpc.aio clients: handshakes with the
self-signed and the loaded certificate, plaintext clients refused, a rotated Secret folder taken
up by new connections while existing ones keep working; health stays plaintext."""

import asyncio
import ssl

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.epp.tls import KeyPair, TlsSettings, self_signed_pair
from dynamograph.protocol.headers import DESTINATION_ENDPOINT

from .conftest import (
    ExtProcClient,
    SecretVolume,
    chat_body,
    endpoint_of,
    request_headers,
    running_epp,
    set_headers,
)

pytestmark = pytest.mark.integration


async def _routes(client: ExtProcClient, workers, text: str) -> None:
    """One whole ext_proc exchange over the client's channel lands on a worker."""
    stream = client.stream()
    first, body, _ = await stream.request(chat_body(text * 20, max_tokens=2))
    assert set_headers(first)[DESTINATION_ENDPOINT] in {endpoint_of(w) for w in workers}
    assert body  # the request body came back re-streamed
    await stream.finish_response()
    await stream.call.done_writing()


async def _refused(client: ExtProcClient) -> grpc.StatusCode:
    call = client.stub.Process()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with asyncio.timeout(20):
            await call.write(request_headers())
            await call.read()
    return info.value.code()


async def _served_certificate(port: int) -> x509.Certificate:
    """The certificate a new TLS connection is shown (no verification: just look)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.transport.abort()  # the server's HTTP/2 preface is unread: no TLS goodbye
    return x509.load_der_x509_certificate(der)


async def test_self_signed_handshake_plaintext_refused_health_plaintext(workers):
    async with running_epp(workers, tls=TlsSettings()) as epp:
        served = epp.certificates.pair
        assert await _served_certificate(epp.grpc_port) == served.certificate
        client = ExtProcClient(epp.grpc_port, root_pem=served.certificate_chain)
        plaintext = ExtProcClient(epp.grpc_port)
        stranger = ExtProcClient(epp.grpc_port, root_pem=self_signed_pair().certificate_chain)
        try:
            await _routes(client, workers, "over tls ")
            assert await _refused(plaintext) == grpc.StatusCode.UNAVAILABLE
            # A client that verifies against another certificate does not get through.
            assert await _refused(stranger) == grpc.StatusCode.UNAVAILABLE
        finally:
            for c in (client, plaintext, stranger):
                await c.close()
        # Kubelet's gRPC probes reach the health port as before: plaintext.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.health_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_rotated_secret_is_served_to_new_connections(workers, tmp_path):
    first, second = self_signed_pair(("localhost",)), self_signed_pair(("localhost",))
    volume = SecretVolume(tmp_path / "epp-tls")
    volume.publish(first)
    async with running_epp(workers, tls=TlsSettings(volume.root, reload=True)) as epp:
        before = ExtProcClient(epp.grpc_port, root_pem=first.certificate_chain)
        clients = [before]
        try:
            await _routes(before, workers, "before rotation ")
            assert await _served_certificate(epp.grpc_port) == first.certificate

            volume.publish(second)  # cert-manager renewed the Secret; the kubelet swapped it
            after = ExtProcClient(epp.grpc_port, root_pem=second.certificate_chain)
            clients.append(after)
            await _routes(after, workers, "after rotation ")
            assert await _served_certificate(epp.grpc_port) == second.certificate
            assert epp.certificates.reloads == 1
            # The connection made before the rotation keeps serving: nothing was dropped.
            await _routes(before, workers, "old connection ")
            # A new connection that only trusts the old certificate is refused now.
            stale = ExtProcClient(epp.grpc_port, root_pem=first.certificate_chain)
            clients.append(stale)
            assert await _refused(stale) == grpc.StatusCode.UNAVAILABLE

            # A half-done rotation (the key of another certificate) is not taken up.
            volume.publish(KeyPair(first.certificate_chain, second.private_key))
            assert await _served_certificate(epp.grpc_port) == second.certificate
            again = ExtProcClient(epp.grpc_port, root_pem=second.certificate_chain)
            clients.append(again)
            await _routes(again, workers, "after a broken rotation ")
            assert epp.certificates.reloads == 1
        finally:
            for c in clients:
                await c.close()


async def test_a_folder_without_reload_keeps_its_first_certificate(workers, tmp_path):
    first = self_signed_pair(("localhost",))
    volume = SecretVolume(tmp_path / "epp-tls")
    volume.publish(first)
    async with running_epp(workers, tls=TlsSettings(volume.root)) as epp:
        volume.publish(self_signed_pair(("localhost",)))
        client = ExtProcClient(epp.grpc_port, root_pem=first.certificate_chain)
        try:
            await _routes(client, workers, "static certificate ")
        finally:
            await client.close()
        assert await _served_certificate(epp.grpc_port) == first.certificate
