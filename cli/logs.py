"""Logging for every dynamograph process: structured (JSON lines) and quiet by default.

JSON when stderr is not a terminal (containers, CI), readable text on a terminal; WARNING unless
`--log-level` (or DYNAMOGRAPH_LOG_LEVEL) asks for more.
"""

import argparse
import logging
import os
import sys

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

# kopf attaches its settings object (queues inside) and a skip flag to every record; they are
# not log content, and serialising the settings dataclass would try to deep-copy its queues.
_NOT_LOGGED = (*RESERVED_ATTRS, "settings", "k8s_skip")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=os.environ.get("DYNAMOGRAPH_LOG_LEVEL", "warning"),
        choices=["debug", "info", "warning", "error"],
        help="log threshold (default: warning, or $DYNAMOGRAPH_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("DYNAMOGRAPH_LOG_FORMAT", "auto"),
        choices=["auto", "json", "text"],
        help="json lines, plain text, or auto: text on a terminal, json otherwise",
    )


def configure_logging(level: str = "warning", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                reserved_attrs=_NOT_LOGGED,
                json_default=repr,
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
