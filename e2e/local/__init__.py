"""The cluster-in-a-box suite: kopf operator on the kmock emulator, a process kubelet, real Envoy."""
