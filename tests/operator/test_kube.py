"""The operator's REST client against a small real HTTP server on 127.0.0.1."""

import kopf
import pytest
from aiohttp import web

from dynamograph.operator.kube import ApiError, KubeApi, collection_path
from dynamograph.worker.testing import refusing_address

pytestmark = pytest.mark.integration


@pytest.fixture
async def server():
    """An aiohttp server whose answer each test sets in state["respond"]; yields (state, URL)."""
    state = {"requests": []}
    app = web.Application()

    async def handler(request: web.Request) -> web.StreamResponse:
        state["requests"].append(
            (request.method, request.path_qs, request.headers.get("Authorization"))
        )
        return await state["respond"](request)

    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def client(url: str, tokens: list[str]) -> KubeApi:
    """A client whose login hands out the next token each time it is called."""
    calls = iter(tokens)
    return KubeApi(lambda: kopf.ConnectionInfo(server=url, token=next(calls), scheme="Bearer"))


async def test_list_filters_and_keys_items(server):
    state, url = server

    async def respond(request):
        return web.json_response(
            {
                "items": [
                    {"metadata": {"name": "a", "labels": {"g": "x", "m": "y"}}},
                    {"metadata": {"name": "b", "labels": {"g": "other"}}},
                ]
            }
        )

    state["respond"] = respond
    api = client(url, ["t1"])
    try:
        items = await api.list("apps/v1", "Deployment", "ns", {"g": "x", "m": "y"})
    finally:
        await api.close()
    assert [i["metadata"]["name"] for i in items] == ["a"]
    assert items[0]["apiVersion"] == "apps/v1" and items[0]["kind"] == "Deployment"
    method, path, auth = state["requests"][0]
    assert (method, auth) == ("GET", "Bearer t1")
    assert path == "/apis/apps/v1/namespaces/ns/deployments?labelSelector=g%3Dx,m%3Dy"


async def test_rotated_token_logs_in_again_once(server):
    state, url = server

    async def respond(request):
        if request.headers["Authorization"] == "Bearer old":
            return web.json_response({"kind": "Status", "reason": "Unauthorized"}, status=401)
        return web.json_response({"metadata": {"name": "g"}})

    state["respond"] = respond
    api = client(url, ["old", "new", "newer"])
    try:
        assert await api.get("v1", "ConfigMap", "ns", "g") == {"metadata": {"name": "g"}}
    finally:
        await api.close()
    assert [r[2] for r in state["requests"]] == ["Bearer old", "Bearer new"]


async def test_errors_carry_the_apiserver_reason(server):
    state, url = server

    async def respond(request):
        if request.method == "PATCH":
            return web.json_response(
                {"kind": "Status", "reason": "Invalid", "message": "spec.replicas: Invalid value"},
                status=422,
            )
        if request.method == "GET":
            return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
        return web.Response(status=500, text="boom")

    state["respond"] = respond
    api = client(url, ["t"])
    try:
        with pytest.raises(ApiError) as info:
            await api.patch("apps/v1", "Deployment", "ns", "d", {"spec": {"replicas": -1}})
        assert (info.value.status, info.value.reason) == (422, "Invalid")
        assert "spec.replicas: Invalid value" in str(info.value)
        assert await api.get("apps/v1", "Deployment", "ns", "d") is None  # 404 -> None
        with pytest.raises(ApiError) as info:
            await api.create(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "s", "namespace": "ns"},
                }
            )
        assert info.value.status == 500 and "boom" in str(info.value)
        with pytest.raises(ApiError):  # only a 404 on delete means "already gone"
            await api.delete("v1", "Service", "ns", "gone")
    finally:
        await api.close()
    patch = next(r for r in state["requests"] if r[0] == "PATCH")
    assert patch[1] == "/apis/apps/v1/namespaces/ns/deployments/d"


# What kube-apiserver v1.36 answers a create in a namespace being deleted (NamespaceLifecycle
# admission), as tests/cluster/test_namespace_deletion.py meets it.
TERMINATING = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'configmaps "c" is forbidden: unable to create new content in namespace x because '
    "it is being terminated",
    "reason": "Forbidden",
    "details": {
        "name": "c",
        "kind": "configmaps",
        "causes": [
            {
                "reason": "NamespaceTerminating",
                "message": "namespace x is being terminated",
                "field": "metadata.namespace",
            }
        ],
    },
    "code": 403,
}
# RBAC's refusal: also 403 Forbidden, without that cause.
RBAC_FORBIDDEN = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "message": 'configmaps is forbidden: User "system:serviceaccount:a:b" cannot create resource '
    '"configmaps" in API group "" in the namespace "x"',
    "reason": "Forbidden",
    "details": {"kind": "configmaps"},
    "code": 403,
}


async def test_a_create_refused_for_a_terminating_namespace_is_told_from_rbac(server):
    state, url = server
    answers = iter([TERMINATING, RBAC_FORBIDDEN])

    async def respond(request):
        return web.json_response(next(answers), status=403)

    state["respond"] = respond
    api = client(url, ["t"])
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "x"}}
    try:
        with pytest.raises(ApiError) as terminating:
            await api.create(cm)
        with pytest.raises(ApiError) as rbac:
            await api.create(cm)
    finally:
        await api.close()
    assert terminating.value.status == 403 and terminating.value.namespace_terminating
    assert rbac.value.status == 403 and not rbac.value.namespace_terminating


async def test_a_namespace_is_listed_by_name(server):
    state, url = server
    namespaces = [{"metadata": {"name": "other"}}, {"metadata": {"name": "ns"}}]

    async def respond(request):
        # unfiltered, as from a server without field selectors: the client picks the one named
        return web.json_response({"kind": "NamespaceList", "items": namespaces})

    state["respond"] = respond
    api = client(url, ["t"])
    try:
        assert await api.namespace("ns") == {"metadata": {"name": "ns"}}
        assert await api.namespace("gone") is None
    finally:
        await api.close()
    assert state["requests"][0][:2] == (
        "GET",
        "/api/v1/namespaces?fieldSelector=metadata.name%3Dns",
    )


async def test_unreachable_server_is_an_api_error():
    with refusing_address() as address:
        api = client(f"http://{address}", ["t"])
        try:
            with pytest.raises(ApiError) as info:
                await api.get("v1", "Service", "ns", "s")
        finally:
            await api.close()
    assert info.value.status == 0 and info.value.reason == "Unreachable"


def test_collection_paths():
    assert collection_path("v1", "Service", "ns") == "/api/v1/namespaces/ns/services"
    assert (
        collection_path("inference.networking.k8s.io/v1", "InferencePool", "ns")
        == "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"
    )
    assert (
        collection_path("kopf.dev/v1", "ClusterKopfPeering", None)
        == "/apis/kopf.dev/v1/clusterkopfpeerings"
    )
    with pytest.raises(ValueError, match="unknown resource"):
        collection_path("v1", "Pod", "ns")
