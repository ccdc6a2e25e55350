"""Defaults of the worker's HTTP server limits (`worker.http_guard`), importable without it."""

MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body over this is refused with 413
HEAD_TIMEOUT_S = 30.0  # a request head must be complete this long after its first byte, else 408
BODY_TIMEOUT_S = 120.0  # a request body must be complete this long after its head, else 408
