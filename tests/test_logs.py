"""JSON logs survive what kopf attaches to records (a settings dataclass holding queues)."""

import dataclasses
import io
import json
import logging
import queue

import pytest

from dynamograph.cli.logs import configure_logging

pytestmark = pytest.mark.unit


@dataclasses.dataclass
class _Settings:
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)


def test_json_lines_drop_kopf_internals_and_keep_the_object_reference(monkeypatch):
    # A logger of our own: kopf hangs its event poster on "kopf.objects" once an operator ran.
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("info", "json")
    try:
        logging.getLogger("tests.logs").info(
            "Handler succeeded.",
            extra={"settings": _Settings(), "k8s_skip": False, "k8s_ref": {"name": "g"}},
        )
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    line = json.loads(stream.getvalue().strip())
    assert line["message"] == "Handler succeeded."
    assert line["k8s_ref"] == {"name": "g"}
    assert "settings" not in line and "k8s_skip" not in line
