"""What local processes and the host's CPUs did, from Linux /proc: the CPU time a process ran
and the time it was ready to run but waited for a CPU (the run queue), summed over its
threads, and how busy the host's CPUs were.

The benchmarks measure routers on a box they share with simulated engines, Envoy and the
client. Where the box runs out of CPU every process waits in the run queue, and a latency
measured there is the box's, not the router's: the wait says so.
"""

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Usage:
    cpu_s: float = 0.0  # ran on a CPU
    wait_s: float = 0.0  # ready to run, waiting for a CPU

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.cpu_s + other.cpu_s, self.wait_s + other.wait_s)

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s)


def usage(pid: int, *, main_thread: bool = False) -> Usage:
    """A process's run and run-queue time so far, all its live threads (or only its main
    thread, the event loop), from the scheduler's nanosecond counts (schedstat). /proc/PID/stat
    counts 10 ms clock ticks, too coarse for requests of a few hundred µs; it is the fallback on
    kernels without schedstat (no wait then). A process that has ended counts nothing."""
    if not Path(f"/proc/{pid}/schedstat").exists():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            stat = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            return Usage((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return Usage()
    threads = _threads(pid, only=pid if main_thread else None)
    return sum((u for _, u in threads), Usage())


def _threads(pid: int, only: int | None = None) -> list[tuple[str, Usage]]:
    """(name, usage) of each live thread of `pid` (or of thread `only`), from schedstat; the
    main thread (the event loop of our Python servers) is named "main thread"."""
    out = []
    tasks = Path(f"/proc/{pid}/task")
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in [tasks / str(only)] if only is not None else tasks.iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread ended
                fields = (task / "schedstat").read_text().split()
                name = (task / "comm").read_text().strip()
                if task.name == str(pid):
                    name = "main thread"  # Python's other threads share its name
                out.append((name, Usage(int(fields[0]) / 1e9, int(fields[1]) / 1e9)))
    return out


def cpu_seconds(pid: int, *, main_thread: bool = False) -> float:
    """CPU time of a process so far (all threads, or its main thread): `usage(pid).cpu_s`."""
    return usage(pid, main_thread=main_thread).cpu_s


def total_usage(pids: Iterable[int]) -> Usage:
    return sum((usage(pid) for pid in pids), Usage())


def usage_by_thread(pids: Iterable[int]) -> dict[str, Usage]:
    """Run and run-queue time so far per thread name (same-named threads summed: a pool's
    workers, one name across processes), over the live threads of `pids`."""
    out: dict[str, Usage] = {}
    for pid in pids:
        for name, u in _threads(pid):
            out[name] = out.get(name, Usage()) + u
    return out


@dataclass(frozen=True)
class HostCpu:
    """The host's CPU time so far (/proc/stat's first line, clock ticks): busy and all."""

    busy: int
    total: int

    @classmethod
    def now(cls) -> "HostCpu":
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return cls(sum(ticks) - idle, sum(ticks))

    def busy_since(self, before: "HostCpu") -> float:
        """Fraction of all the host's CPUs busy between `before` and this reading."""
        total = self.total - before.total
        return (self.busy - before.busy) / total if total > 0 else 0.0


@dataclass(frozen=True)
class GroupUsage:
    """What named groups of processes and the host's CPUs did over `seconds` of wall time."""

    seconds: float
    host_busy: float  # fraction of all the host's CPUs
    groups: dict[str, Usage]
    threads: dict[str, dict[str, Usage]]  # per group, per thread name (`usage_by_thread`)

    def as_json(self) -> dict:
        """Per group, CPU and run-queue wait per second of wall time (cores' worth)."""
        per_s = max(self.seconds, 1e-9)
        return {
            "seconds": self.seconds,
            "cpus": os.cpu_count(),
            "host_busy": self.host_busy,
            "cpu_per_s": {k: u.cpu_s / per_s for k, u in self.groups.items()},
            "wait_per_s": {k: u.wait_s / per_s for k, u in self.groups.items()},
            "threads": {
                group: {
                    name: {"cpu_per_s": u.cpu_s / per_s, "wait_per_s": u.wait_s / per_s}
                    for name, u in sorted(threads.items(), key=lambda kv: -kv[1].cpu_s)
                }
                for group, threads in self.threads.items()
            },
        }


class Watch:
    """From its creation on: the usage of named groups of processes and the host's CPUs."""

    def __init__(self, groups: dict[str, Iterable[int]]) -> None:
        self._pids = {name: list(pids) for name, pids in groups.items()}
        self._before = {name: usage_by_thread(pids) for name, pids in self._pids.items()}
        self._host = HostCpu.now()
        self._start = time.monotonic()

    def read(self) -> GroupUsage:
        threads = {}
        for group, pids in self._pids.items():
            before, now = self._before[group], usage_by_thread(pids)
            threads[group] = {name: u - before.get(name, Usage()) for name, u in now.items()}
        return GroupUsage(
            seconds=time.monotonic() - self._start,
            host_busy=HostCpu.now().busy_since(self._host),
            groups={g: sum(t.values(), Usage()) for g, t in threads.items()},
            threads=threads,
        )
