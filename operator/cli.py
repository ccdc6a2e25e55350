"""`dynamograph operator`: run the kopf operator that reconciles DynamoGraph resources.

Standalone by default: one operator, no peering objects needed. With `--peering NAME`, several
replicas share kopf's peering object NAME (a ClusterKopfPeering, or a KopfPeering per watched
namespace): each records keep-alives in it, and every replica but the one with the highest
priority pauses (stops watching) until the higher ones are gone. That is kopf's own peering,
used as leader election; `run_options` turns the flags into `kopf.run` arguments.

A peered operator refuses to start without its peering object (`missing_peering`): kopf would
wait for it silently, paused, and once it appeared the operator would act unregistered (its
first keep-alive already failed) until its next keep-alive, up to a minute, invisible to a
second replica. Exiting instead makes Kubernetes restart the pod, which registers at once.
"""

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from .config import PULL_POLICIES, OperatorConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: $WATCH_NAMESPACE, else all)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--image",
        help="image for the graph's pods (default: $DYNAMOGRAPH_IMAGE, else this release's)",
    )
    parser.add_argument(
        "--image-pull-policy",
        choices=PULL_POLICIES,
        help="imagePullPolicy of the pods (default: $DYNAMOGRAPH_IMAGE_PULL_POLICY or IfNotPresent)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        help="period of the drift-repair and status timer (default: $DYNAMOGRAPH_RESYNC_SECONDS or 30)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=8080,
        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz (0: off)",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="run as one of several replicas sharing kopf's peering object NAME: only the "
        "highest-priority one acts (default: $DYNAMOGRAPH_PEERING, else standalone)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        help="peering priority (default: $DYNAMOGRAPH_PEERING_PRIORITY, else automatic: the "
        "longest-running replica leads, and any explicit priority outranks automatic ones)",
    )


def config_from_args(args: argparse.Namespace, env=os.environ) -> OperatorConfig:
    base = OperatorConfig.from_env(env)
    return dataclasses.replace(
        base,
        image=args.image or base.image,
        image_pull_policy=args.image_pull_policy or base.image_pull_policy,
        resync_seconds=args.resync_seconds or base.resync_seconds,
    )


def automatic_priority(started: float, rng: random.Random) -> int:
    """The peering priority of a replica started at `started` (epoch seconds).

    Earlier start, higher priority: the running leader keeps leading when another replica
    restarts, and a rollout's new pod waits (paused) until the old leader has gone, instead of
    both acting at once. Negative, so an explicit priority (kopf's default 0, `--dev`'s 666)
    always outranks the replicas. The last three digits are random: kopf pauses *every*
    operator of a same-priority tie, so two pods started in the same millisecond must differ.
    """
    return -(int(started * 1000) * 1000 + rng.randrange(1000))


def run_options(
    args: argparse.Namespace,
    env: Mapping[str, str] = os.environ,
    clock: Callable[[], float] = time.time,
    rng: random.Random | None = None,
) -> dict[str, Any]:
    """The `kopf.run` keyword arguments for these flags and environment. Raises ValueError."""
    if args.all_namespaces:
        namespaces: list[str] = []
    else:
        namespaces = args.namespace or [
            ns.strip() for ns in env.get("WATCH_NAMESPACE", "").split(",") if ns.strip()
        ]
    peering = args.peering or env.get("DYNAMOGRAPH_PEERING") or None
    priority = args.priority
    if priority is None and env.get("DYNAMOGRAPH_PEERING_PRIORITY"):
        try:
            priority = int(env["DYNAMOGRAPH_PEERING_PRIORITY"])
        except ValueError:
            raise ValueError("DYNAMOGRAPH_PEERING_PRIORITY must be an integer") from None
    if peering is None and priority is not None:
        raise ValueError("a peering priority needs a peering object (--peering NAME)")
    if peering is not None and priority is None:
        priority = automatic_priority(clock(), rng or random.SystemRandom())
    return {
        "clusterwide": not namespaces,
        "namespaces": namespaces,
        "standalone": peering is None,
        "peering_name": peering,
        "priority": priority,
        "liveness_endpoint": f"http://0.0.0.0:{args.liveness_port}/healthz"
        if args.liveness_port
        else None,
    }


async def missing_peering(name: str, namespaces: list[str]) -> list[str]:
    """The peering objects kopf will use (a ClusterKopfPeering, or a KopfPeering per watched
    namespace) that do not exist. Unreadable ones (no RBAC, API down) are logged, not counted."""
    import kopf

    from .kube import ApiError, KubeApi, login

    if namespaces:
        # kopf namespace patterns (globs, exclusions) name no single object: not checked.
        wanted: list[tuple[str, str | None]] = [
            ("KopfPeering", ns) for ns in namespaces if not set(ns) & set("*?[!")
        ]
    else:
        wanted = [("ClusterKopfPeering", None)]
    api = KubeApi(lambda: login(kopf.OperatorSettings()))
    missing = []
    try:
        for kind, namespace in wanted:
            try:
                found = await api.get("kopf.dev/v1", kind, namespace, name)
            except ApiError as exc:  # a 404 (no CRD or no object) is None, not an error
                log.warning("cannot check %s %s: %s", kind, name, exc)
                continue
            if found is None:
                missing.append(
                    f"{kind} {name}" + (f" in namespace {namespace}" if namespace else "")
                )
    finally:
        await api.close()
    return missing


def run(args: argparse.Namespace) -> int:
    import kopf

    from .handlers import build_registry

    try:
        config = config_from_args(args)
        options = run_options(args)
    except ValueError as exc:
        print(f"dynamograph operator: {exc}")
        return 2
    peering = options["peering_name"]
    if peering:
        missing = asyncio.run(missing_peering(peering, options["namespaces"]))
        if missing:
            print(
                f"dynamograph operator: peering object missing: {', '.join(missing)}. The Helm "
                "chart creates it; else apply kopf's peering CRDs (crds/kopfpeerings.kopf.dev.yaml)"
                f" and create it, e.g. {{apiVersion: kopf.dev/v1, kind: ClusterKopfPeering, "
                f"metadata: {{name: {peering}}}}}"
            )
            return 1
        log.info("peering %r with priority %d", peering, options["priority"])
    kopf.run(registry=build_registry(config), **options)
    return 0
