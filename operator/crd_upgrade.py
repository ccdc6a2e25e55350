"""The operator brings the DynamoGraph CRD up to date when it starts.

Helm installs the chart's `crds/` on `helm install` and never touches them again: `helm upgrade`
skips that folder, so a chart upgrade alone would run a new operator against the previous
version's schema (new fields pruned or refused). Like Cilium's and Tigera's operators, this one
applies the CRD it was built with (`crds.build_crd`) with server-side apply on start, before it
watches anything, as field manager `dynamograph-operator` (forcing fields `helm install` set).

The CRD records the operator version that applied it (annotation
`dynamograph.io/operator-version`); an operator older than that leaves it alone, so a stale
replica (or a rollback) never strips fields a newer one added. Every replica does this when it
starts, a paused standby (kopf peering) too: in a rolling update the new CRD is in place before
the new pod leads.

The chart grants `get` and `patch` on this one CRD only (`resourceNames`), not `create`: the
CRD must exist (helm install) for the operator to have anything to reconcile. With the grant
withheld (chart value `manageCRD: false`, for clusters whose CRDs are managed elsewhere) the
operator says so and runs with the CRD as it is; no failure here stops it.

Then, before kopf watches, the operator waits (at most `SERVED_WITHIN_S`) until the apiserver
lists DynamoGraphs: a CRD whose spec just changed (by this start, or by anyone) makes the
apiserver rebuild the resource's storage, and meanwhile it answers 429 "storage is
(re)initializing", which kopf's first watch would log as an ERROR. The apiserver drops the old
storage a moment after the change, not with it: after changing the spec itself, the operator
waits for that rebuild to come and go (`REBUILD_WITHIN_S`), not just for one list answered.
"""

import asyncio
import importlib.metadata
import logging
from typing import Any

from packaging.version import InvalidVersion, Version

from dynamograph.protocol.graph import API_VERSION, KIND

from .crds import CRD_NAME, build_crd
from .kube import ApiError, KubeApi

log = logging.getLogger(__name__)

FIELD_MANAGER = "dynamograph-operator"
VERSION_ANNOTATION = "dynamograph.io/operator-version"
CRD_API_VERSION = "apiextensions.k8s.io/v1"
CRD_KIND = "CustomResourceDefinition"
SERVED_WITHIN_S = 30.0
REBUILD_WITHIN_S = 5.0  # how long a spec change may take to reach the apiserver's storage
_SERVED_POLL_S = 0.1


def operator_version() -> str:
    return importlib.metadata.version("dynamograph")


def newer_than(live: dict[str, Any] | None, ours: str) -> str | None:
    """The version that applied the live CRD when it is newer than `ours`, else None."""
    theirs = ((live or {}).get("metadata", {}).get("annotations") or {}).get(VERSION_ANNOTATION)
    try:
        return theirs if theirs and Version(theirs) > Version(ours) else None
    except InvalidVersion:
        return None  # not a version we wrote: ours replaces it


def desired_crd(version: str) -> dict[str, Any]:
    crd = build_crd()
    crd["metadata"]["annotations"] = {VERSION_ANNOTATION: version}
    return crd


async def upgrade_crd(api: KubeApi, version: str | None = None) -> bool:
    """Apply our CRD unless a newer operator's is there; True when that changed its spec (a new
    `metadata.generation`: the apiserver rebuilds the resource's storage)."""
    version = version or operator_version()
    try:
        live = await api.get(CRD_API_VERSION, CRD_KIND, None, CRD_NAME)
        if live is None:
            log.warning(
                "CRD %s is not installed; install the chart (helm installs it) or apply "
                "crds/%s.yaml",
                CRD_NAME,
                CRD_NAME,
            )
            return False
        newer = newer_than(live, version)
        if newer:
            log.info(
                "CRD %s was applied by operator %s, newer than %s: kept", CRD_NAME, newer, version
            )
            return False
        applied = await api.apply(desired_crd(version), FIELD_MANAGER)
    except ApiError as exc:
        if exc.status == 403:
            log.info(
                "not allowed to update CRD %s (chart value manageCRD: false?); running with "
                "the CRD as installed",
                CRD_NAME,
            )
        else:
            log.warning("could not update CRD %s: %s; running with it as installed", CRD_NAME, exc)
        return False
    log.info("CRD %s applied (operator %s)", CRD_NAME, version)
    return _generation(applied) != _generation(live)


def _generation(obj: dict[str, Any] | None) -> int | None:
    return ((obj or {}).get("metadata") or {}).get("generation")


async def wait_until_served(
    api: KubeApi,
    *,
    spec_changed: bool = False,
    within_s: float = SERVED_WITHIN_S,
    rebuild_within_s: float = REBUILD_WITHIN_S,
) -> bool:
    """True once the apiserver answers a list of DynamoGraphs (all namespaces, as kopf watches)
    with anything but 429, its answer while it (re)builds the resource's storage. After a spec
    change of ours (`spec_changed`), the old storage may still answer at first: then also until
    a rebuild has been seen and is over, or `rebuild_within_s` passed without one (it was over
    between two lists). False, logged, when the apiserver still answers 429 after `within_s`
    (kopf retries its watches anyway)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    rebuilding_seen = False
    while True:
        try:
            await api.list(API_VERSION, KIND, None, {})
            if rebuilding_seen or not spec_changed or loop.time() - start >= rebuild_within_s:
                return True
        except ApiError as exc:
            if exc.status != 429:
                return True  # served, or not for us to wait on (not installed, not allowed)
            rebuilding_seen = True
            if loop.time() - start >= within_s:
                log.warning("%s storage still rebuilding after %.0f s: %s", KIND, within_s, exc)
                return False
        await asyncio.sleep(_SERVED_POLL_S)
