"""`dynamograph bench hashing`: our block hashing against Dynamo's, alternately in one run.

An 8,192-token prompt at block size 16 (512 blocks). Ours takes what our tokenizer produces (a
u32 numpy array); Dynamo's binding takes a Python list, so it is measured from a list, and ours
from a list too, for the like-for-like row. Then, in a second pass against Dynamo again, ours
after `hashing.warm_up()`: the compiled kernel the EPP and the frontend's kv mode hash with.
"""

import argparse

import numpy as np

from dynamograph.protocol import hashing
from dynamograph.protocol.hashing import block_hashes

from .report import add_output_argument, print_table, write_json
from .timing import alternate, percentiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    add_output_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        from dynamo._core import compute_block_hash_for_seq
    except ImportError:
        print("bench hashing needs PyPI ai-dynamo-runtime (the dev extra) for the comparison")
        return 2
    rng = np.random.default_rng(0)
    array = rng.integers(0, 151_000, args.tokens, dtype=np.uint32)
    tokens = array.tolist()
    bs = args.block_size
    assert block_hashes(array, bs) == compute_block_hash_for_seq(tokens, bs)
    dynamo = {"dynamo (list)": lambda: compute_block_hash_for_seq(tokens, bs)}
    per_block = alternate(
        {
            **dynamo,
            "ours (u32 array)": lambda: block_hashes(array, bs),
            "ours (list)": lambda: block_hashes(tokens, bs),
        },
        rounds=args.rounds,
    )
    hashing.warm_up()  # from here on block_hashes runs the compiled kernel
    assert block_hashes(array, bs) == compute_block_hash_for_seq(tokens, bs)
    compiled = alternate(
        {**dynamo, "ours compiled (u32 array)": lambda: block_hashes(array, bs)},
        rounds=args.rounds,
    )
    stats, ratios = {}, {}
    for samples in (per_block, compiled):  # each pass against its own Dynamo baseline
        part = {name: percentiles(s) for name, s in samples.items()}
        base = part["dynamo (list)"]["p50"]
        for name, s in part.items():
            if name not in stats:
                stats[name], ratios[name] = s, s["p50"] / base
    rows = [[name, s["p50"], s["p99"], ratios[name]] for name, s in stats.items()]
    print_table(
        f"block hashing, {args.tokens} tokens, block size {bs} (µs per prompt)",
        ["implementation", "p50 µs", "p99 µs", "ratio vs dynamo (p50)"],
        rows,
    )
    write_json(
        args.out,
        "hashing",
        {
            "tokens": args.tokens,
            "block_size": bs,
            "rounds": args.rounds,
            "results_us": stats,
            "ratio_p50": ratios,
        },
    )
    return 0
