"""bench/procstat.py: run and run-queue time of real processes, read from /proc."""

import os
import subprocess
import sys
import time

import pytest

from dynamograph.bench.procstat import HostCpu, Usage, Watch, usage

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/schedstat"), reason="needs Linux /proc schedstat"
)


def spinners(count: int, seconds: float, cpu: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)]) for _ in range(count)]
    for p in procs:
        os.sched_setaffinity(p.pid, {cpu})
    return procs


def test_processes_sharing_one_cpu_wait_for_it():
    cpu = min(os.sched_getaffinity(0))
    procs = spinners(3, 1.5, cpu)
    try:
        watch = Watch({"spinners": [p.pid for p in procs], "none": []})
        time.sleep(1.0)
        got = watch.read()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    spun = got.groups["spinners"]
    # three busy loops on one CPU: together they run about one CPU's worth, and each is
    # ready to run while another has the CPU, so together they wait about twice that
    assert 0.5 < spun.cpu_s / got.seconds <= 1.05
    assert spun.wait_s > spun.cpu_s
    assert got.groups["none"] == Usage()
    # per thread name: the three spinners' main threads count together
    (name, threads), *_ = sorted(got.threads["spinners"].items(), key=lambda kv: -kv[1].cpu_s)
    assert name == "main thread" and threads.cpu_s > 0.9 * spun.cpu_s
    assert sum(got.threads["spinners"].values(), Usage()) == spun
    assert 0 < got.host_busy <= 1
    assert set(got.as_json()["wait_per_s"]) == {"spinners", "none"}


def test_an_idle_process_does_not_wait_and_an_ended_one_counts_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        before = usage(proc.pid)
        time.sleep(0.5)
        idle = usage(proc.pid) - before
        assert idle.cpu_s < 0.05 and idle.wait_s < 0.05
        main = usage(proc.pid, main_thread=True)
        assert 0 < main.cpu_s <= usage(proc.pid).cpu_s
    finally:
        proc.kill()
        proc.wait()
    assert usage(proc.pid) == Usage()


def test_host_cpu_counts_forward():
    before = HostCpu.now()
    spinners(1, 0.3, min(os.sched_getaffinity(0)))[0].wait()
    after = HostCpu.now()
    assert after.total > before.total and after.busy > before.busy
    assert 0 < after.busy_since(before) <= 1
