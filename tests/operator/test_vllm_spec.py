"""Real vLLM serving in the DynamoGraph spec, spec -> desired objects (pure): tensor and pipeline
parallel sizes driving the GPU count, engine arguments passed through (flags we set refused),
/dev/shm, the model cache, placement, startup and progress deadlines that agree, the reserved
multinode field, and `spec.replicas` acting on the scale target."""

import copy

import kubernetes_validate
import pytest
import yaml

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import (
    PROGRESS_MARGIN_SECONDS,
    Owner,
    desired_objects,
)
from dynamograph.protocol.graph import MODEL_CACHE_DIR, GraphError, load_graph

from .emulator import EXAMPLES

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

CONFIG = OperatorConfig(image="registry.example/dynamograph:1.2.3")
K8S_VERSION = "1.33"


def example() -> dict:
    return yaml.safe_load((EXAMPLES / "vllm-tp.yaml").read_text())


def deployments(body: dict) -> dict[str, dict]:
    graph = load_graph(body)
    objects = desired_objects(graph, Owner(graph.name, "serving", "uid"), CONFIG)
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def engine_of(deployment: dict) -> dict:
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
    )


def refused(body: dict) -> list[tuple[str, str]]:
    with pytest.raises(GraphError) as info:
        load_graph(body)
    return info.value.errors


def test_a_tensor_parallel_70b_renders_what_vllm_needs():
    worker = deployments(example())["llama70b-worker"]
    pod = worker["spec"]["template"]["spec"]
    engine = engine_of(worker)
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # engine arguments reach `vllm serve` through the worker, in order
    assert [a for a in args if a.startswith("--vllm-arg=")] == [
        "--vllm-arg=--gpu-memory-utilization=0.92",
        "--vllm-arg=--kv-cache-dtype=fp8",
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["model-cache"] == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "hf-cache"},
    }
    assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert {"name": "model-cache", "mountPath": MODEL_CACHE_DIR} in engine["volumeMounts"]
    assert {"name": "HF_HOME", "value": MODEL_CACHE_DIR} in engine["env"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    # startup allowance 2400 s; the Deployment waits that long plus scheduling and pulling
    probe = engine["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 2400
    assert worker["spec"]["progressDeadlineSeconds"] == 2400 + PROGRESS_MARGIN_SECONDS
    assert worker["spec"]["replicas"] == 2  # spec.replicas, the scale target's count
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


def test_default_deadlines_agree_for_both_backends():
    """vLLM's default startup allowance is 1,800 s; the progress deadline is never shorter
    (Kubernetes' own default, 600 s, marked a loading vLLM pod's rollout failed)."""
    for backend, allowance in (("vllm", 1800), ("mock", 300)):
        body = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
        body["spec"]["backend"] = backend
        body["spec"]["services"]["worker"]["resources"] = {}
        worker = deployments(body)["agg-worker"]
        probe = engine_of(worker)["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == allowance
        assert worker["spec"]["progressDeadlineSeconds"] >= allowance + PROGRESS_MARGIN_SECONDS
        # the EPP loads no model: Kubernetes' default deadline
        assert "progressDeadlineSeconds" not in deployments(body)["agg-epp"]["spec"]


@pytest.mark.parametrize(
    ("sizes", "gpus"),
    [
        ({}, 1),
        ({"tensorParallelSize": 8}, 8),
        ({"tensorParallelSize": 2, "pipelineParallelSize": 2}, 4),
        ({"tensorParallelSize": 2, "dataParallelSize": 2}, 4),
    ],
)
def test_gpus_per_pod_follow_the_parallel_sizes(sizes, gpus):
    body = example()
    worker = body["spec"]["services"]["worker"]
    worker.pop("tensorParallelSize")
    worker.update(sizes)
    engine = engine_of(deployments(body)["llama70b-worker"])
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    body["spec"]["services"]["worker"]["resources"]["gpu"] = gpus  # the same count, spelled out
    assert engine_of(deployments(body)["llama70b-worker"]) == engine


def test_no_gpu_is_vllms_cpu_backend():
    body = example()
    body["spec"]["services"]["worker"]["resources"]["gpu"] = 0
    engine = engine_of(deployments(body)["llama70b-worker"])
    assert "nvidia.com/gpu" not in engine["resources"]["limits"]


def test_a_gpu_count_that_disagrees_with_the_parallel_sizes_is_refused():
    body = example()
    body["spec"]["services"]["worker"]["resources"]["gpu"] = 2
    ((path, message),) = refused(body)
    assert path == "spec.services.worker.resources.gpu"
    assert "= 4 GPUs, not 2" in message


@pytest.mark.parametrize(
    ("argument", "field"),
    [
        ("--tensor-parallel-size=8", "tensorParallelSize"),
        ("-tp", "tensorParallelSize"),
        ("--max_model_len=4096", "engine.contextLength"),
        ("--port", "the contract's ports"),
        ("--no-enable-prefix-caching", "always on"),
        ("--served-model-name=other", "model.servedModelName"),
    ],
)
def test_engine_arguments_may_not_repeat_flags_we_set(argument, field):
    body = example()
    body["spec"]["services"]["worker"]["engine"]["extraArgs"].append(argument)
    ((path, message),) = refused(body)
    assert path == "spec.services.worker.engine.extraArgs"
    assert repr(argument) in message and field in message


def test_vllm_settings_are_refused_for_the_mock():
    for setting in ({"tensorParallelSize": 2}, {"engine": {"extraArgs": ["--enforce-eager"]}}):
        body = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
        body["spec"]["services"]["worker"].update(setting)
        ((path, message),) = refused(body)
        assert path == "spec.services.worker" and "vllm settings" in message


@pytest.mark.parametrize(
    ("mutate", "path", "words"),
    [
        (
            lambda s: s["model"]["cache"].update(hostPath="/mnt/hf"),
            "spec.model.cache.claimName",
            "exactly one of claimName and hostPath",
        ),
        (
            lambda s: s["model"].update(cache={}),
            "spec.model.cache.claimName",
            "exactly one of claimName and hostPath",
        ),
        (
            lambda s: s["services"]["worker"].update(multinode={"nodeCount": 2}),
            "spec.services.worker.multinode.nodeCount",
            "less than or equal to 1",
        ),
        (
            lambda s: s["services"]["worker"].update(
                nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100"}
            ),
            "spec.services.worker.gpuType",
            "set one of the two",
        ),
        (
            lambda s: s["services"]["epp"].update(sharedMemory="1Gi"),
            "spec.services.epp.sharedMemory",
            "run no engine",
        ),
        (
            lambda s: s["services"]["worker"]["tolerations"].append({"effect": "NoSchedule"}),
            "spec.services.worker.tolerations[1].key",
            "needs operator Exists",
        ),
    ],
)
def test_invalid_vllm_settings_name_the_field(mutate, path, words):
    body = example()
    mutate(body["spec"])
    errors = refused(body)
    assert [p for p, m in errors if p == path and words in m], errors


def test_a_host_path_cache_and_affinity_render():
    body = example()
    body["spec"]["model"]["cache"] = {"hostPath": "/mnt/hf", "readOnly": True}
    affinity = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"dynamograph.io/graph": "llama70b"}},
                    },
                }
            ]
        }
    }
    body["spec"]["services"]["worker"]["affinity"] = copy.deepcopy(affinity)
    worker = deployments(body)["llama70b-worker"]
    pod = worker["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["hostPath"] == {"path": "/mnt/hf", "type": "DirectoryOrCreate"}
    mount = next(m for m in engine_of(worker)["volumeMounts"] if m["name"] == "model-cache")
    assert mount["readOnly"] is True
    assert pod["affinity"] == affinity
    kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


def test_the_mock_gets_no_shared_memory_unless_asked():
    body = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    assert "volumes" not in deployments(body)["agg-worker"]["spec"]["template"]["spec"]
    body["spec"]["services"]["worker"]["sharedMemory"] = "2Gi"
    (shm,) = deployments(body)["agg-worker"]["spec"]["template"]["spec"]["volumes"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


# ---- spec.replicas and the scale target ---------------------------------------------------


def test_spec_replicas_drives_the_only_serving_service():
    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    body["spec"]["replicas"] = 5
    graph = load_graph(body)
    assert graph.spec.scale_target_service == "decode"
    assert graph.spec.services["decode"].replicas == 5
    assert deployments(body)["disagg-decode"]["spec"]["replicas"] == 5
    # the others keep their own counts
    prefill = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())["spec"]["services"]["prefill"]
    assert deployments(body)["disagg-prefill"]["spec"]["replicas"] == prefill.get("replicas", 1)


def test_spec_replicas_with_a_named_scale_target():
    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    body["spec"].update(replicas=3, scaleTarget="prefill")
    assert deployments(body)["disagg-prefill"]["spec"]["replicas"] == 3


def test_spec_replicas_is_refused_when_the_target_is_ambiguous():
    body = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    body["spec"]["services"]["worker2"] = {"componentType": "worker"}
    assert load_graph(copy.deepcopy(body)).spec.scale_target_service is None  # fine unscaled
    body["spec"]["replicas"] = 2
    ((path, message),) = refused(body)
    assert path == "spec.replicas" and "scaleTarget" in message
    body["spec"]["scaleTarget"] = "nope"
    errors = refused(body)
    assert errors[0][0] == "spec.scaleTarget" and "'nope' is not a service" in errors[0][1]


def test_status_scale_is_the_targets_deployment_and_selector():
    from dynamograph.operator.controller import scale_status

    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    graph = load_graph(body)
    live = {("apps/v1", "Deployment", "disagg-decode"): {"status": {"replicas": 3}}}
    scale = scale_status(graph, "disagg", live)
    assert scale is not None
    assert (scale.service, scale.replicas) == ("decode", 3)
    assert scale.selector == "dynamograph.io/graph=disagg,dynamograph.io/service=decode"
    assert scale_status(graph, "disagg", {}).replicas == 0  # no Deployment yet
    assert scale_status(None, "disagg", live) is None  # an invalid spec
    body["spec"]["services"]["decode2"] = {"componentType": "decode"}
    assert scale_status(load_graph(body), "disagg", live) is None  # no single target


def test_the_engine_pods_run_the_vllm_image_the_example_names():
    """The project image has no vLLM: the example's worker service names an image that has it
    (docs/operator.md, "A real vLLM graph"); its sidecar runs there too, the EPP keeps ours."""
    body = example()
    vllm_image = body["spec"]["services"]["worker"]["image"]
    assert vllm_image != CONFIG.image
    rendered = deployments(body)
    pod = rendered["llama70b-worker"]["spec"]["template"]["spec"]
    assert {c["name"]: c["image"] for c in pod["containers"]} == {
        "engine": vllm_image,
        "frontend": vllm_image,
    }
    epp = next(d for name, d in rendered.items() if name.endswith("-epp"))
    assert {c["image"] for c in epp["spec"]["template"]["spec"]["containers"]} == {CONFIG.image}


def test_the_epp_reads_the_tokenizer_the_example_keeps_in_the_model_cache():
    """Llama's tokenizer is a file in the model cache: the EPP, which tokenizes every prompt with
    it, mounts the cache read-only; the engines keep their writable mount."""
    rendered = deployments(example())
    epp = rendered["llama70b-epp"]["spec"]["template"]["spec"]
    cache = next(v for v in epp["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "hf-cache", "readOnly": True}
    (container,) = epp["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
    assert mount == {"name": "model-cache", "mountPath": MODEL_CACHE_DIR, "readOnly": True}
    engine = engine_of(rendered["llama70b-worker"])
    assert [m for m in engine["volumeMounts"] if m["name"] == "model-cache"] == [
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR}
    ]
    kubernetes_validate.validate(rendered["llama70b-epp"], K8S_VERSION, strict=True)
    # a tokenizer elsewhere (or a Qwen vocabulary) leaves the EPP without the cache
    body = example()
    body["spec"]["model"]["tokenizer"] = "qwen"
    epp = deployments(body)["llama70b-epp"]["spec"]["template"]["spec"]
    assert all(v["name"] != "model-cache" for v in epp["volumes"])


def test_a_vllm_graph_names_the_tokenizer_of_a_model_we_do_not_ship():
    """Qwen ids would match none of Llama's KV events: the graph says so rather than route
    without overlap; a Qwen model, or the mock backend (which simulates any model), needs none."""
    body = example()
    del body["spec"]["model"]["tokenizer"]
    errors = refused(body)
    assert [m for _, m in errors if "model.tokenizer" in m and "tokenizer.json" in m], errors
    body["spec"]["model"]["name"] = "Qwen/Qwen2.5-72B-Instruct"
    load_graph(body)
    mock = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    mock["spec"]["model"]["name"] = "meta-llama/Llama-3.1-8B-Instruct"
    load_graph(mock)
