"""Compiling numba kernels before first use, protocol's and the router index's alike: each
for its one signature, loaded from numba's on-disk cache when there is one (compiled in memory
when numba cannot write a cache), and never compiled again afterwards (a call with other types
fails instead of compiling while a request waits). Imports numba when called: only processes
that warm a kernel up load it.
"""

import logging
import warnings
from typing import Any

log = logging.getLogger(__name__)


def compile_ahead(dispatcher: Any, signature: Any, what: str) -> Any:
    """`dispatcher` (a numba.njit function) compiled for `signature`: the caller types it."""
    import numba

    with warnings.catch_warnings():
        # a cache that cannot be written is not worth a warning
        warnings.simplefilter("ignore", numba.NumbaWarning)
        try:
            dispatcher.enable_caching()
        except RuntimeError:  # nowhere to write numba's cache: compile in memory
            log.debug("numba cannot cache the %s kernel here", what)
        dispatcher.compile(signature)
    dispatcher.disable_compile()
    return dispatcher
