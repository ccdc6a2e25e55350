"""The real kubectl against the API emulator: `apply --dry-run=client` of the CRD and examples.

kubectl resolves kinds through the server's discovery, so it needs a server even for a
client-side dry run; the emulator provides one. Its OpenAPI-based validation needs
`/openapi/v3`, which the emulator lacks, hence `--validate=false` (schemas are checked by
test_crds.py, test_cel.py and test_manifests.py instead).
"""

import asyncio
import os

import pytest

from .emulator import NAMESPACE, REPO

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

KUBECTL = REPO / ".local" / "bin" / "kubectl"


async def kubectl(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        str(KUBECTL),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HOME": os.environ.get("TMPDIR", "/tmp")},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            "crds",
            "customresourcedefinition.apiextensions.k8s.io/dynamographs.dynamograph.io created (dry run)",
        ),
        ("examples/agg.yaml", "dynamograph.dynamograph.io/agg created (dry run)"),
        ("examples/disagg.yaml", "dynamograph.dynamograph.io/disagg created (dry run)"),
    ],
)
async def test_kubectl_apply_dry_run(cluster, path, expected):
    if not KUBECTL.exists():
        pytest.skip("kubectl is missing: run scripts/fetch-helm.sh (scripts/setup.sh runs it)")
    code, out = await kubectl(
        "apply", "--dry-run=client", "--validate=false", "-n", NAMESPACE, "-f", str(REPO / path)
    )
    assert code == 0, out
    assert expected in out
