"""The operator's CRD upgrade on start, pure parts: which live CRD it replaces and what it applies
(the apply itself, after a real `helm upgrade`: tests/cluster/test_helm_upgrade.py)."""

import pytest

from dynamograph.operator import crds
from dynamograph.operator.crd_upgrade import VERSION_ANNOTATION, desired_crd, newer_than

pytestmark = pytest.mark.unit


def live(version: str | None) -> dict:
    annotations = {} if version is None else {VERSION_ANNOTATION: version}
    return {"metadata": {"name": crds.CRD_NAME, "annotations": annotations}}


@pytest.mark.parametrize(
    ("theirs", "kept"),
    [
        (None, False),  # installed by helm: no annotation, ours replaces it
        ("0.1.0", False),  # the same version: applied again (idempotent)
        ("0.0.9", False),
        ("0.2.0", True),  # a newer operator's: kept
        ("1.0.0rc1", True),
        ("not-a-version", False),
    ],
)
def test_only_a_newer_operators_crd_is_kept(theirs, kept):
    assert (newer_than(live(theirs), "0.1.0") is not None) is kept


def test_the_applied_crd_is_the_generated_one_with_its_version():
    crd = desired_crd("0.1.0")
    assert crd["metadata"]["annotations"] == {VERSION_ANNOTATION: "0.1.0"}
    del crd["metadata"]["annotations"]
    assert crd == crds.build_crd()
