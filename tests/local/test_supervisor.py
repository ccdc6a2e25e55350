"""The restart policy with small real processes: a killed process comes back after its back-off;
one that fails at once every time is given up after a bounded number of restarts, and logged."""

import json
import os
import signal
import socket

import aiohttp
import pytest

from dynamograph.local import procs
from dynamograph.local.stack import STATE_FILE, Stack
from dynamograph.local.supervisor import RestartPolicy, Supervisor
from e2e.waiting import wait_for

from .test_stack import child_pid, make_plan, ports, server

pytestmark = pytest.mark.integration

__all__ = ["ports"]  # the fixture, shared with test_stack

FAST = RestartPolicy(first_delay=0.05, max_delay=0.4, stable_after=30.0, give_up_after=4)


def log_lines(stack: Stack) -> list[dict]:
    path = stack.run_dir / "logs" / "supervisor.log"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def supervise_until(supervisor, session, condition, what, within=30):
    events: list[str] = []

    async def step():
        events.extend(await supervisor.tick(session))
        return condition()

    await wait_for(step, what, within=within, interval=0.05, detail=lambda: "\n".join(events))
    return events


async def test_a_killed_process_is_restarted_in_place_and_recorded(tmp_path, ports):
    specs = [server(tmp_path, "a", ports[0]), server(tmp_path, "b", ports[1])]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    supervisor = Supervisor(stack, FAST)
    try:
        await stack.start(ready_within=60)
        victim = stack.running[1]
        old_pid, old_child = victim.pid, child_pid(tmp_path, "b")
        os.kill(old_pid, signal.SIGKILL)
        async with aiohttp.ClientSession() as session:
            events = await supervise_until(
                supervisor,
                session,
                lambda: victim.restarts == 1 and victim.state == "running",
                "b to be restarted and ready",
            )
        assert victim.pid != old_pid and victim.poll() is None
        # What the killed run forked died with it: a restart never runs beside its leftovers.
        await wait_for(
            lambda: not procs.is_live(old_child), "what it forked to die with it", within=5
        )
        assert child_pid(tmp_path, "b") != old_child and procs.is_live(child_pid(tmp_path, "b"))
        assert victim.last_exit == "killed by signal 9"
        assert any("b killed by signal 9; restarting in 0.05s" in e for e in events), events
        assert any("b is back (restart 1)" in e for e in events), events
        assert stack.running[0].restarts == 0 and stack.running[0].state == "running"
        died, back = log_lines(stack)
        assert died["process"] == "b" and died["level"] == "warning" and died["delay_s"] == 0.05
        assert died["last_exit"] == "killed by signal 9" and died["state"] == "backing-off"
        assert back["message"] == "ready again" and back["restarts"] == 1
        # The state file (what `up --status` reads) carries it too.
        stack.save_state()
        attached, _ = Stack.attach(stack.run_dir)
        b = attached.running[1]
        assert (b.pid, b.restarts, b.last_exit) == (victim.pid, 1, "killed by signal 9")
        assert (stack.run_dir / STATE_FILE).is_file()
    finally:
        stack.stop(grace=5)
    assert stack.live() == []


async def test_a_process_failing_at_once_every_time_is_given_up_without_a_storm(tmp_path, ports):
    specs = [server(tmp_path, "a", ports[0]), server(tmp_path, "b", ports[1])]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    supervisor = Supervisor(stack, FAST)
    squatter = socket.socket()
    try:
        await stack.start(ready_within=60)
        victim = stack.running[1]
        first_child = child_pid(tmp_path, "b")
        os.kill(victim.pid, signal.SIGKILL)
        await wait_for(lambda: victim.poll() is not None, "b to die", within=10)
        await wait_for(
            lambda: not procs.is_live(first_child), "what it forked to die with it", within=5
        )
        # Its port taken by someone else: every restart exits at once ("address in use").
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", ports[1]))
        squatter.listen()
        async with aiohttp.ClientSession() as session:
            events = await supervise_until(
                supervisor, session, lambda: victim.state == "given-up", "b to be given up"
            )
            # Given up means left alone: more rounds start nothing.
            for _ in range(5):
                assert await supervisor.tick(session) == []
        assert victim.restarts == FAST.give_up_after - 1 and victim.poll() is not None
        assert victim.last_exit == "exited with code 1"
        assert "gave up after 4 failures in a row" in events[-1], events
        lines = log_lines(stack)
        assert [line["level"] for line in lines] == ["warning"] * 3 + ["error"]
        assert [line.get("delay_s") for line in lines[:3]] == [0.05, 0.1, 0.2]  # doubling
        assert "fix the cause" in lines[-1]["message"] and str(victim.log) in lines[-1]["message"]
        assert "Address already in use" in victim.log.read_text()  # every run's output kept
        assert stack.running[0].state == "running" and stack.running[0].poll() is None
    finally:
        squatter.close()
        stack.stop(grace=5)
    assert stack.live() == []


def test_back_off_doubles_up_to_its_bound():
    policy = RestartPolicy(first_delay=0.5, max_delay=4.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


async def test_a_process_that_ran_long_enough_starts_a_new_series(tmp_path, ports):
    specs = [server(tmp_path, "a", ports[0])]
    stack = Stack(make_plan(specs, ports[0]), tmp_path / "run")
    supervisor = Supervisor(stack, RestartPolicy(first_delay=0.05, stable_after=0.0))
    try:
        await stack.start(ready_within=60)
        proc = stack.running[0]
        proc.failures = 3  # an earlier series
        os.kill(proc.pid, signal.SIGKILL)
        async with aiohttp.ClientSession() as session:
            await supervise_until(supervisor, session, lambda: proc.restarts == 1, "a restart")
        assert proc.failures == 1
    finally:
        stack.stop(grace=5)
