"""The supervisor with small real processes: readiness, deaths, group stop, state file, down."""

import asyncio
import os
import signal
import sys
import textwrap

import pytest

from dynamograph.local import procs
from dynamograph.local.down import stop_run
from dynamograph.local.spec import Plan, Probe, ProcessSpec
from dynamograph.local.stack import STATE_FILE, Stack, StackError, recorded_runs
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

# An HTTP server answering 200 on every path after `delay` seconds, with a child process in its
# process group (like an engine that forks helpers): stopping must take both.
SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    port, delay, child_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(child_file, "w").write(str(child.pid))
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def server(tmp_path, name, port, stage=0, delay=0.0):
    return ProcessSpec(
        name=name,
        kind="engine",
        argv=(sys.executable, "-c", SERVER, str(port), str(delay), str(tmp_path / f"{name}.child")),
        stage=stage,
        ready=Probe("http", f"http://127.0.0.1:{port}/health"),
        ports={"engine": port},
        engine_url=f"http://127.0.0.1:{port}",
    )


def make_plan(specs, gateway_port):
    return Plan(
        graph="t",
        model="m",
        processes=specs,
        base_url=f"http://127.0.0.1:{gateway_port}/v1",
        files={},
        notes=[],
    )


@pytest.fixture
def ports():
    pool = procs.PortPool()
    taken = [pool.take() for _ in range(4)]
    pool.release()
    return taken


def child_pid(tmp_path, name):
    return int((tmp_path / f"{name}.child").read_text())


async def test_start_in_stages_record_state_and_stop_whole_groups(tmp_path, ports):
    run_dir = tmp_path / "run"
    specs = [server(tmp_path, "a", ports[0]), server(tmp_path, "b", ports[1], stage=1, delay=0.5)]
    stack = Stack(make_plan(specs, ports[1]), run_dir)
    try:
        await stack.start(ready_within=60)
        assert [p.spec.name for p in stack.live()] == ["a", "b"]
        state = run_dir / STATE_FILE
        assert state.is_file() and recorded_runs(tmp_path) == [run_dir]
        children = [child_pid(tmp_path, "a"), child_pid(tmp_path, "b")]
        assert all(procs.is_live(pid) for pid in children)
        assert not procs.port_is_free(ports[0])
    finally:
        left = stack.stop(grace=5)
    assert left == []
    assert not any(procs.is_live(pid) for pid in children)  # grandchildren went with the group
    assert all(procs.group_members(p.pid) == [] for p in stack.running)
    assert procs.port_is_free(ports[0]) and procs.port_is_free(ports[1])


async def test_a_process_dying_while_starting_fails_the_start_and_stops_the_rest(tmp_path, ports):
    crash = ProcessSpec(
        name="crash",
        kind="engine",
        argv=(sys.executable, "-c", "import sys; print('no GPU here', flush=True); sys.exit(3)"),
        stage=0,
        ready=Probe("http", f"http://127.0.0.1:{ports[1]}/health"),
        ports={},
    )
    specs = [server(tmp_path, "a", ports[0], delay=0.2), crash]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    with pytest.raises(StackError, match=r"crash exited with code 3(.|\n)*no GPU here"):
        await stack.start(ready_within=60)
    assert stack.live() == []
    assert procs.port_is_free(ports[0])


async def test_not_ready_in_time_names_the_process(tmp_path, ports):
    specs = [server(tmp_path, "slow", ports[0], delay=30)]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    with pytest.raises(StackError, match="not ready in time: slow"):
        await stack.start(ready_within=1.0)
    assert stack.live() == []


async def test_reap_reports_a_killed_process_once(tmp_path, ports):
    specs = [server(tmp_path, "a", ports[0]), server(tmp_path, "b", ports[1])]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    try:
        await stack.start(ready_within=60)
        victim = stack.running[1]
        orphan = child_pid(tmp_path, "b")
        os.kill(victim.pid, signal.SIGKILL)
        dead = await wait_for(stack.reap, "the killed process to be reaped", within=10)
        assert [p.spec.name for p in dead] == ["b"]
        await wait_for(lambda: not procs.is_live(orphan), "what it forked to die with it", within=5)
        assert procs.is_live(child_pid(tmp_path, "a"))
        assert dead[0].describe_exit() == "killed by signal 9"
        assert stack.reap() == []
        assert [p.spec.name for p in stack.live()] == ["a"]
    finally:
        stack.stop(grace=5)


async def test_down_stops_a_stack_from_its_state_file(tmp_path, ports):
    """What `dynamograph down` does after `up --detach` has returned."""
    run_dir = tmp_path / "run"
    specs = [server(tmp_path, "a", ports[0]), server(tmp_path, "b", ports[1])]
    stack = Stack(make_plan(specs, ports[0]), run_dir)
    await stack.start(ready_within=60)
    children = [child_pid(tmp_path, "a"), child_pid(tmp_path, "b")]
    attached, _ = Stack.attach(run_dir)
    assert [(p.pid, p.started) for p in attached.running] == [
        (p.pid, p.started) for p in stack.running
    ]
    assert attached.ports() == sorted(ports[:2])
    try:
        assert await asyncio.to_thread(stop_run, run_dir, 5.0)
    finally:
        stack.stop(grace=1)
    assert not (run_dir / STATE_FILE).exists()
    assert not any(procs.is_live(pid) for pid in [*children, *(p.pid for p in stack.running)])
    assert procs.port_is_free(ports[0]) and procs.port_is_free(ports[1])


def test_a_reused_pid_is_never_signalled(tmp_path):
    """A recorded pid whose start time differs is someone else's process now."""
    me = os.getpid()
    assert procs.same_process(me, procs.start_time(me))
    assert not procs.same_process(me, procs.start_time(me) - 1)
    assert not procs.same_process(me, None)


def test_port_pool_gives_distinct_consecutive_blocks():
    pool = procs.PortPool()
    try:
        a = pool.take(3)
        b = pool.take(1)
        assert b not in (a, a + 1, a + 2)
        assert not procs.port_is_free(a + 1)  # held until released
    finally:
        pool.release()
    assert procs.port_is_free(a + 1)
