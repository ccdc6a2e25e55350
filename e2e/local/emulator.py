"""The API server of the cluster-in-a-box: the operator tests' kmock layer, reused as is.

`tests/operator/emulator.py` extends kmock 0.8 with what an API server must do for kopf and
for controllers (uid/resourceVersion/generation stamping, status isolation, label selectors,
ownerReference garbage collection) and declares the built-in kinds, the project's CRD and the
upstream InferencePool/HTTPRoute CRDs for discovery. Its stand-in Deployment controller (which
reports every rollout finished at once) is switched off here: the process kubelet runs the pods
and reports the Deployments' real status.
"""

from tests.operator.emulator import ClusterEmulator, declare_resources


def make_emulator() -> ClusterEmulator:
    """An emulator for the cluster-in-a-box; enter it (`async with`) and serve it with
    `kmock.Server`."""
    emulator = ClusterEmulator()
    emulator.rollouts_complete = False
    declare_resources(emulator)
    return emulator
