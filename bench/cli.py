"""`dynamograph bench NAME`: one command per benchmark, each printing a table and writing JSON."""

import argparse
import signal

from dynamograph.cli.main import Command, NotBuilt, load

BENCHMARKS = {
    "hashing": Command("dynamograph.bench.hashing", "block hashing: ours vs Dynamo's, same run"),
    "index": Command("dynamograph.bench.index", "KV index: ours vs Dynamo's RadixTree"),
    "worker": Command("dynamograph.bench.worker", "mock engine: simulated vs wall-clock timing"),
    "epp": Command("dynamograph.bench.epp", "endpoint picker: routed requests/s and pick latency"),
    "prefill-signal": Command(
        "dynamograph.bench.prefill_signal", "EPP: how late it learns a prefill is done, by signal"
    ),
    "schedule": Command(
        "dynamograph.bench.schedule", "router core: schedule + free CPU time, A/B vs a revision"
    ),
    "frontend": Command("dynamograph.bench.frontend", "frontend hop: added latency vs direct"),
    "route": Command(
        "dynamograph.bench.route", "routing quality on a trace, against other routers"
    ),
    "soak": Command(
        "dynamograph.bench.soak",
        "long run near capacity with worker kills: requests lost, bookings, RSS",
    ),
    "speculative": Command(
        "dynamograph.bench.speculative",
        "speculative prefill: follow-up TTFT of multi-turn sessions with and without it",
    ),
    "priority": Command(
        "dynamograph.bench.priority", "TTFT of high-priority requests under overload, with/without"
    ),
    "all": Command("dynamograph.bench.all", "every benchmark above with a summary table"),
}

# `dynamograph` fills in the benchmark named on the command line (cli.main.add_lazy_subcommands).
SUBCOMMANDS = BENCHMARKS


def run(args: argparse.Namespace) -> int:
    try:
        module = load(BENCHMARKS[args.bench])
    except NotBuilt:
        print(f"dynamograph bench {args.bench}: this benchmark is not built yet")
        return 2
    # Killed (a CI timeout, `kill`, a closed terminal): stop as on Ctrl-C, so the benchmark's
    # `finally` blocks stop the workers, routers and gateways it started instead of leaving them
    # running without it.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    return module.run(args) or 0
