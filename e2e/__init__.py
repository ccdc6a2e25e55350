"""End-to-end suites (test tier 4): `e2e/kind` on a real kind cluster, `e2e/local` on a
Kubernetes API emulator with a process kubelet. Shared scenario helpers live at this level."""
