"""`dynamograph epp --processes N`: N EPP processes behind one set of ports.

The parent runs this same command line N times, each child told its index
(`PROCESS_INDEX_ENV`). Every child is a full EPP (its own discovery, KV-event subscriptions,
index and router) and a replica of the others (router/replicas.py: bookings shared over
loopback). The children share the gRPC and health ports with SO_REUSEPORT, so the kernel spreads
the gateway's connections over them (per connection, not per stream). Their Prometheus pages
differ, so each child serves /metrics on 127.0.0.1 at `--metrics-port + 1 + i` and the parent
serves `--metrics-port` itself: every child's page merged, each sample labelled
`process="<i>"` (one scrape target for Prometheus, as with one process).

A child that exits is started again (a new replica: its siblings drop the old one's bookings
when the new one says hello under the same name). SIGTERM/SIGINT go to every child, which
drains; the parent exits when all have.
"""

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PROCESS_INDEX_ENV = "DYNAMOGRAPH_EPP_PROCESS_INDEX"
CHILD_METRICS_HOST = "127.0.0.1"


def process_index() -> int | None:
    """This process's index among `--processes`, or None in the parent / a single process."""
    value = os.environ.get(PROCESS_INDEX_ENV)
    return None if value is None else int(value)


def child_metrics_port(base: int, index: int) -> int:
    return base + 1 + index


class _Merged(Collector):
    """The children's pages as one: each family once, each sample labelled with its process."""

    def __init__(self, pages: Iterable[tuple[int, str]]):
        self.pages = pages

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for index, text in self.pages:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = {**sample.labels, "process": str(index)}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from families.values()


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


def merged_page(base: int, count: int, timeout: float = 2.0) -> bytes:
    """Every reachable child's /metrics, merged (a child restarting is left out meanwhile)."""
    pages = []
    for index in range(count):
        url = f"http://{CHILD_METRICS_HOST}:{child_metrics_port(base, index)}/metrics"
        with contextlib.suppress(OSError), _LOOPBACK.open(url, timeout=timeout) as page:
            pages.append((index, page.read().decode()))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(pages))
    return generate_latest(registry)


def _serve_metrics(host: str, port: int, count: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = merged_page(port, count)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="epp-metrics", daemon=True).start()
    return server


def run_processes(count: int, host: str, metrics_port: int) -> int:
    """Run `count` EPP processes (this command line again, each told its index) until
    SIGTERM/SIGINT, which every child gets (each drains); restart a child that exits."""
    stopping = False
    children: dict[int, subprocess.Popen[bytes]] = {}

    def start(i: int) -> None:
        env = {**os.environ, PROCESS_INDEX_ENV: str(i)}
        argv = [sys.executable, "-m", "dynamograph.cli", *sys.argv[1:]]
        children[i] = subprocess.Popen(argv, env=env)

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = _serve_metrics(host, metrics_port, count) if metrics_port else None
    try:
        for i in range(count):
            start(i)
        while not stopping:
            pid, status = os.wait()  # retried after a signal handler ran (PEP 475)
            index = next((i for i, c in children.items() if c.pid == pid), None)
            if index is None:
                continue
            children[index].returncode = code = os.waitstatus_to_exitcode(status)
            if not stopping:
                log.error("EPP process %d exited (%d); starting it again", index, code)
                time.sleep(1.0)  # a process failing at start must not spin
                start(index)
        return max(abs(child.wait()) for child in children.values())
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
