"""Operator test fixtures: the emulator of `emulator.py` as kmock's server class, with the
resources declared and $KUBECONFIG (also as the `kubernetes` client's default) pointing at it."""

import os

import pytest
from kubernetes.config import kube_config

from .emulator import ClusterEmulator, declare_resources, write_kubeconfig


@pytest.fixture
def kmock_options(kmock_options):
    return {**kmock_options, "cls": ClusterEmulator}


@pytest.fixture
def cluster(request, kmock, tmp_path, monkeypatch):
    """The emulator with resources declared and $KUBECONFIG pointing at it. Parametrize it
    indirectly with a tuple of kinds to leave their CRDs out."""
    declare_resources(kmock, without=getattr(request, "param", ()))
    config = write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    monkeypatch.setenv("KUBECONFIG", str(config))
    # The `kubernetes` client (the operator's login) reads $KUBECONFIG once, at import.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
    # kopf checks for a pod's service account first; make sure a developer machine has none.
    assert not os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")
    return kmock
