"""Operator-wide settings: which image the pods run and how often graphs are re-checked.

Read from the environment (the Helm chart sets them on the operator Deployment) and overridable
by `dynamograph operator` flags. A service's own `image` field wins over the operator's image.
"""

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass

IMAGE_REPOSITORY = "ghcr.io/dynamograph/dynamograph"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def default_image() -> str:
    """The image of this very release: pods run the same dynamograph as the operator."""
    try:
        version = importlib.metadata.version("dynamograph")
    except importlib.metadata.PackageNotFoundError:
        version = "latest"
    return f"{IMAGE_REPOSITORY}:{version}"


@dataclass(frozen=True)
class OperatorConfig:
    image: str
    image_pull_policy: str = "IfNotPresent"
    # Timer period for drift repair and status refresh; Deployment events act sooner.
    resync_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("the operator needs a default image (DYNAMOGRAPH_IMAGE)")
        if self.image_pull_policy not in PULL_POLICIES:
            raise ValueError(
                f"image pull policy must be one of {', '.join(PULL_POLICIES)}, "
                f"not {self.image_pull_policy!r}"
            )
        if self.resync_seconds <= 0:
            raise ValueError("the resync period must be positive")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "OperatorConfig":
        """DYNAMOGRAPH_IMAGE, DYNAMOGRAPH_IMAGE_PULL_POLICY, DYNAMOGRAPH_RESYNC_SECONDS."""
        try:
            resync = float(env.get("DYNAMOGRAPH_RESYNC_SECONDS", "30"))
        except ValueError:
            raise ValueError("DYNAMOGRAPH_RESYNC_SECONDS must be a number of seconds") from None
        return cls(
            image=env.get("DYNAMOGRAPH_IMAGE") or default_image(),
            image_pull_policy=env.get("DYNAMOGRAPH_IMAGE_PULL_POLICY", "IfNotPresent"),
            resync_seconds=resync,
        )
