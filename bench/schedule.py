"""`dynamograph bench schedule`: CPU time of the router core's `schedule` + free, A/B in process.

The EPP's schedule stage alone (no tokenizing, hashing or gRPC), on a fleet like `bench epp`'s:
`--workers` single-rank workers, `--families` shared prefixes of `--prefix-blocks` blocks, each
stored on one worker through real KV events (`BlockStored` with token ids, so the index holds
what a vLLM fleet would report), and requests of `--prompt-blocks` blocks: a family's prefix
plus a unique tail. `--live` requests stay booked while the next are scheduled (the oldest is
freed as each new one is booked), as under a gateway's concurrency.

With `--baseline REV` the router core of git revision REV (its `router/` folder, or the `epp/`
modules it lived in before, with the RouterConfig of that revision, extracted with `git show`
into a temporary package) runs beside the current one, on identical state, request by
request, who goes first alternating: CPU time (`time.process_time`) of schedule + the free it
triggers, per request, for each; and every decision is compared (worker, rank, overlap, cost),
so the bench also checks that a faster scheduler routes exactly as the old one did.
"""

import argparse
import gc
import importlib
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from .report import add_output_argument, print_table, write_json
from .timing import percentiles

# Before the router core had its own folder it lived in epp/, with these modules.
_EPP_CORE = ("scheduler", "plugins", "active", "index", "kernels", "table", "holders", "seqtrack")
_EPP_OPTIONAL = ("config", "columns", "fleet")
_CONFIG_MODULE = "dynamograph.protocol.router_config"
BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="single-rank workers (64)")
    parser.add_argument("--families", type=int, default=32, help="shared prefixes (32)")
    parser.add_argument("--prefix-blocks", type=int, default=384, help="blocks per prefix (384)")
    parser.add_argument("--prompt-blocks", type=int, default=512, help="blocks per request (512)")
    parser.add_argument("--requests", type=int, default=2000, help="requests timed (2000)")
    parser.add_argument("--live", type=int, default=8, help="requests kept booked (8)")
    parser.add_argument(
        "--empty-index",
        action="store_true",
        help="store nothing in the index (as `bench epp`'s in-process stage table does)",
    )
    parser.add_argument(
        "--baseline", help="git revision whose router core runs beside the current one (A/B)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_output_argument(parser)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def _core_files(repo: Path, sha: str, rev: str) -> dict[str, str]:
    """The router core of `sha`: its path in the package → its source. The core's folder and
    the RouterConfig it was built against (read from the revision, not today's protocol/)."""
    listed = _git(repo, "ls-tree", "-r", "--name-only", sha, "--", "router/").stdout.split()
    paths = {p.removeprefix("router/"): p for p in listed if p.endswith(".py")}
    if not paths:  # the older layout
        paths = {f"{m}.py": f"epp/{m}.py" for m in _EPP_CORE + _EPP_OPTIONAL}
    paths["router_config.py"] = "protocol/router_config.py"
    files = {}
    for name, path in paths.items():
        shown = _git(repo, "show", f"{sha}:{path}")
        if shown.returncode == 0:
            files[name] = shown.stdout
        elif name.removesuffix(".py") in _EPP_CORE:
            raise SystemExit(f"revision {rev} has no {path}")
    return files


def _baseline_package(rev: str) -> str:
    """The router core of `rev` as an importable package (a folder under the temp dir)."""
    repo = Path(__file__).resolve().parent.parent
    sha = _git(repo, "rev-parse", "--short", rev).stdout.strip()
    if not sha:
        raise SystemExit(f"{rev} is not a git revision of {repo}")
    root = Path(tempfile.gettempdir()) / "dynamograph-bench-schedule"
    name = f"baseline_{sha}"
    for relative, text in _core_files(repo, sha, rev).items():
        if relative == "kernels.py" and text == _current_source("kernels"):
            # the same kernels: share the compiled ones instead of compiling a copy (seconds)
            text = _SHARED_KERNELS
        text = text.replace(_CONFIG_MODULE, f"{name}.router_config")
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return name


_SHARED_KERNELS = """import sys

from dynamograph.router import kernels

sys.modules[__name__] = kernels
"""


def _current_source(module: str) -> str:
    source_file = importlib.import_module(f"dynamograph.router.{module}").__file__
    assert source_file is not None  # a module of ours, loaded from its .py file
    return Path(source_file).read_text()


def _fleet(scheduler, args, prefixes: list[list[int]]):
    """A router with `args.workers` workers; prefix family i stored on worker i % workers."""
    from dynamograph.protocol.kv_events import BlockStored, EventBatch

    router = scheduler.Router(scheduler.RouterConfig(seed=args.seed))
    for w in range(args.workers):
        router.add_worker(w + 1, block_size=BLOCK_SIZE, total_blocks=65536)
    seqs: dict[int, int] = {}
    for i, toks in enumerate([] if args.empty_index else prefixes):
        worker = i % args.workers + 1
        engine = [(worker << 40) + (i << 20) + b for b in range(len(toks) // BLOCK_SIZE)]
        seq = seqs.get(worker, 0)
        seqs[worker] = seq + 1
        batch = EventBatch(0.0, [BlockStored(engine, None, toks, BLOCK_SIZE, None)])
        assert router.apply_kv_batch(worker, seq, batch) is None
    return router


def _decision_key(decision) -> tuple:
    d = decision.decode
    return d.worker_id, d.dp_rank, d.overlap_blocks, d.cost


def run(args) -> int:
    from dynamograph.protocol.hashing import block_hash_array

    rng = random.Random(args.seed)
    vocab = 150_000
    prefix_tokens = args.prefix_blocks * BLOCK_SIZE
    tail_tokens = (args.prompt_blocks - args.prefix_blocks) * BLOCK_SIZE + BLOCK_SIZE // 2
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(args.families)]
    requests = []
    for _ in range(args.requests + 20):
        toks = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(tail_tokens)]
        requests.append((block_hash_array(toks, BLOCK_SIZE, None), len(toks)))

    impls = {"current": importlib.import_module("dynamograph.router.scheduler")}
    if args.baseline:
        package = _baseline_package(args.baseline)
        impls = {
            f"baseline {args.baseline}": importlib.import_module(f"{package}.scheduler"),
            **impls,
        }
    routers = {name: _fleet(mod, args, prefixes) for name, mod in impls.items()}
    gc.collect()
    gc.freeze()  # as the EPP does once started: collections skip the startup heap
    live: dict[str, deque[Any]] = {name: deque() for name in impls}
    samples = {name: np.empty(args.requests) for name in impls}
    names = list(impls)
    mismatches = 0
    clock = time.process_time
    for n, (hashes, isl) in enumerate(requests):
        timed = n - 20  # the first 20 warm up
        order = names if n % 2 == 0 else names[::-1]
        keys = {}
        for name in order:
            request = impls[name].RouteRequest(f"r{n}", hashes, isl)
            queue = live[name]
            start = clock()
            decision = routers[name].schedule(request)
            queue.append(decision.guard)
            if len(queue) > args.live:
                queue.popleft().free()
            spent = clock() - start
            if timed >= 0:
                samples[name][timed] = spent
            keys[name] = _decision_key(decision)
        if len(set(keys.values())) > 1:
            mismatches += 1
    for queue in live.values():
        while queue:
            queue.popleft().free()
    stats = {name: percentiles(s) for name, s in samples.items()}
    rows = [[name, s["p50"], s["p99"], s["mean"]] for name, s in stats.items()]
    held = "an empty index" if args.empty_index else "each family's prefix on one worker"
    print_table(
        f"schedule + free, CPU µs per request: {args.workers} workers, {args.prompt_blocks}-block "
        f"prompts ({args.prefix_blocks} shared by {args.families} families), {held}, "
        f"{args.live} live",
        ["router core", "p50 µs", "p99 µs", "mean µs"],
        rows,
    )
    if len(impls) > 1:
        print(f"decisions differing between the two: {mismatches} of {len(requests)}")
    write_json(
        args.out,
        "schedule",
        {
            "args": {k: v for k, v in vars(args).items() if k != "out" and not callable(v)}
            | {"out": str(args.out)},
            "cpu_us": stats,
            "decision_mismatches": mismatches if len(impls) > 1 else None,
        },
    )
    return 1 if mismatches else 0
