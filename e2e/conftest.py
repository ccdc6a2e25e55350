"""Both e2e suites import shared test infrastructure by package path (`e2e.*`, and the operator
tests' kmock layer as `tests.operator.emulator`): make the repository root importable however
pytest was started. A test module may leave no process running (`tests/process_guard.py`)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.process_guard import module_stops_its_processes  # noqa: E402 (needs ROOT on the path)

__all__ = ["module_stops_its_processes"]  # autouse
