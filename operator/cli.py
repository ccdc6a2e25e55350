"""`dynamograph operator`: run the kopf operator that reconciles DynamoGraph resources."""

import argparse
import os

from .config import PULL_POLICIES, OperatorConfig


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


def config_from_args(args: argparse.Namespace, env=os.environ) -> OperatorConfig:
    base = OperatorConfig.from_env(env)
    return OperatorConfig(
        image=args.image or base.image,
        image_pull_policy=args.image_pull_policy or base.image_pull_policy,
        resync_seconds=args.resync_seconds or base.resync_seconds,
    )


def run(args: argparse.Namespace) -> int:
    import kopf

    from .handlers import build_registry

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"dynamograph operator: {exc}")
        return 2
    namespaces = args.namespace or [
        ns for ns in os.environ.get("WATCH_NAMESPACE", "").split(",") if ns.strip()
    ]
    kopf.run(
        registry=build_registry(config),
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,  # one replica (the chart's Deployment uses Recreate); no peering CRDs
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz"
        if args.liveness_port
        else None,
    )
    return 0
