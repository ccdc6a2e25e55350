"""The EPP's TLS choice in a DynamoGraph (`services.<epp>.tls`): what the operator renders for
each mode (args, volumes, Service appProtocol), that the EPP's own CLI reads those args as
meant, and that the CRD's rules and the models refuse the same specs."""

import argparse
import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dynamograph.epp.cli import add_arguments, tls_from_args
from dynamograph.epp.tls import TlsSettings, self_signed_pair
from dynamograph.operator import crds
from dynamograph.protocol.graph import GraphError, load_graph

from .emulator import EXAMPLES
from .test_manifests import K8S_VERSION, build, container, with_gateway

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

cel = pytest.importorskip("tests.operator.cel", reason="cel-python is not installed")


def with_tls(**tls):
    def mutate(body):
        with_gateway(body)
        body["spec"]["services"]["epp"]["tls"] = tls

    return mutate


def _epp(objs):
    deployment = objs["Deployment", "disagg-epp"]
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment, "epp")
    service = objs["Service", "disagg-epp"]
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return deployment, pod, main, grpc_port


def _cli_tls(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args[1:])  # after the `epp` subcommand


ROUTER_MOUNT = {"name": "router-config", "mountPath": "/etc/dynamograph/router", "readOnly": True}


def test_default_is_self_signed_tls_like_gaie():
    _, objs = build("disagg.yaml", with_gateway)
    deployment, pod, main, grpc_port = _epp(objs)
    assert main["args"][-1] == "--secure-serving=true"
    assert "--cert-path" not in main["args"]
    assert main["volumeMounts"] == [ROUTER_MOUNT]
    assert [v["name"] for v in pod["volumes"]] == ["router-config"]
    assert grpc_port["appProtocol"] == "http2"  # HTTP/2 inside TLS, as GAIE's chart says
    assert tls_from_args(_cli_tls(main["args"])) == TlsSettings()
    # The InferencePool stays as GAIE v1 defines it: TLS is the default it implies.
    assert objs["InferencePool", "disagg"]["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "disagg-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_plaintext_serves_h2c():
    _, objs = build("disagg.yaml", with_tls(mode="Plaintext"))
    _, pod, main, grpc_port = _epp(objs)
    assert main["args"][-1] == "--secure-serving=false"
    assert main["volumeMounts"] == [ROUTER_MOUNT]
    assert [v["name"] for v in pod["volumes"]] == ["router-config"]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    assert tls_from_args(_cli_tls(main["args"])) is None


def test_secret_is_mounted_and_reloaded(tmp_path):
    _, objs = build("disagg.yaml", with_tls(mode="Secret", secretName="epp-cert"))
    deployment, pod, main, grpc_port = _epp(objs)
    assert main["args"][-4:] == [
        "--secure-serving=true",
        "--cert-path",
        "/etc/dynamograph/epp-tls",
        "--enable-cert-reload=true",
    ]
    assert main["volumeMounts"] == [
        ROUTER_MOUNT,
        {"name": "epp-tls", "mountPath": "/etc/dynamograph/epp-tls", "readOnly": True},
    ]
    assert pod["volumes"][1] == {"name": "epp-tls", "secret": {"secretName": "epp-cert"}}
    assert grpc_port["appProtocol"] == "http2"
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    # The EPP reads those flags as a reloaded folder (here with a real pair in place).
    args = _cli_tls(main["args"])
    assert args.cert_path == "/etc/dynamograph/epp-tls"
    pair = self_signed_pair(("localhost",))
    (tmp_path / "tls.crt").write_bytes(pair.certificate_chain)
    (tmp_path / "tls.key").write_bytes(pair.private_key)
    args.cert_path = str(tmp_path)
    assert tls_from_args(args) == TlsSettings(tmp_path, reload=True)


def _agg() -> dict:
    return yaml.safe_load((EXAMPLES / "agg.yaml").read_text())


def _crd_refuses(body) -> list[str]:
    version = next(v for v in crds.build_crd()["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    messages = [m for _, m in cel.evaluate(schema, body).failures]
    try:
        jsonschema.Draft4Validator(schema).validate(
            {k: v for k, v in body.items() if k != "metadata"}
        )
    except jsonschema.ValidationError as exc:
        messages.append(exc.message)
    return messages


@pytest.mark.parametrize(
    ("service", "tls", "message", "field"),
    [
        (
            "epp",
            {"mode": "Secret"},
            "mode Secret needs the name",
            "spec.services.epp.tls.secretName",
        ),
        (
            "epp",
            {"mode": "SelfSigned", "secretName": "x"},
            "only mode Secret uses a Secret",
            "spec.services.epp.tls.secretName",
        ),
        ("worker", {"mode": "Plaintext"}, "tls:", "spec.services.worker.tls"),
        ("epp", {"mode": "Optional"}, "Optional", "spec.services.epp.tls.mode"),
        (
            "epp",
            {"mode": "Secret", "secretName": "Bad_Name"},
            "Bad_Name",
            "spec.services.epp.tls.secretName",
        ),
    ],
)
def test_crd_and_models_refuse_the_same_tls_specs(service, tls, message, field):
    body = _agg()
    body["spec"]["services"][service]["tls"] = tls
    assert [m for m in _crd_refuses(body) if message in m], _crd_refuses(body)
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(body))
    assert field in [path for path, _ in info.value.errors], info.value


def test_crd_accepts_each_mode():
    body = _agg()
    for tls in (
        {},
        {"mode": "Plaintext"},
        {"mode": "SelfSigned"},
        {"mode": "Secret", "secretName": "epp-cert"},
    ):
        body["spec"]["services"]["epp"]["tls"] = tls
        assert _crd_refuses(body) == []
        load_graph(copy.deepcopy(body))
