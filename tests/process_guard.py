"""A guard for test folders whose tests start processes: once a test module is done (its
tests and its fixtures), none of the processes started while it ran may still run, the ones
they forked included (orphans outlive their parent). tests/conftest.py and e2e/conftest.py
import the fixture (autouse); tests/cluster and e2e/kind override it with one that checks nothing.

Per module, not per test: a module's fixture may run a supervised stack that restarts a
process during a test, and that process is the fixture's to stop. Not for folders with
session-scoped fixtures that run processes (the control plane, the kind cluster): those outlive
a module.
"""

import contextlib
import os
import signal
import time
import uuid

import pytest

from dynamograph.local import procs

# Every process started while a module runs inherits this variable with the module's own value,
# also the ones it forks. After the module none may be left: a stop that missed a process
# group's members shows up here.
TAG = "DYNAMOGRAPH_TEST_PROCESS_TAG"
# Helpers multiprocessing starts once for the whole interpreter (the first module to spawn a
# process starts them); they end with the test run.
_RUNTIME_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def tagged_processes(tag: str) -> dict[int, str]:
    """Live processes (not this one) whose environment carries `TAG=tag`: pid -> command."""
    marker = f"{TAG}={tag}".encode()
    found = {}
    for entry in procs.PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(helper in command for helper in _RUNTIME_HELPERS):
            continue
        if marker in environ.split(b"\0") and procs.is_live(int(entry.name)):
            found[int(entry.name)] = command.decode(errors="replace").strip()
    return found


def assert_no_process_left(tag: str, what: str, within: float = 5.0) -> None:
    """Wait up to `within` seconds for `tag`'s processes to end; kill and name any left."""
    deadline = time.monotonic() + within
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"{what} left processes running: {left}"


@pytest.fixture(scope="module", autouse=True)
def module_stops_its_processes(request):
    tag = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TAG, tag)
        yield
    assert_no_process_left(tag, f"test module {request.module.__name__}")
