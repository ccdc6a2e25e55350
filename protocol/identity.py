"""Worker identity: the one function that turns a pod (or local process) name into an instance id.

Instance id = XXH3-64 of the name, masked to 63 bits, written in decimal in the
routing headers. Every component calls this function; none computes the id another way.
"""

import os
import socket

import xxhash

_MASK_63 = (1 << 63) - 1


def instance_id(name: str) -> int:
    """XXH3-64 (seed 0) of the UTF-8 name, masked to 63 bits so it fits a signed i64 as well."""
    if not name:
        raise ValueError("instance_id needs a non-empty pod or process name")
    return xxhash.xxh3_64_intdigest(name.encode()) & _MASK_63


def default_worker_name() -> str:
    """A worker's name when none is given: its pod's (POD_NAME, from the downward API), else the
    host's."""
    return os.environ.get("POD_NAME") or socket.gethostname()
