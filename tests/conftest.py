"""Every test folder: a test module may leave no process running (`tests/process_guard.py`)."""

from tests.process_guard import module_stops_its_processes

__all__ = ["module_stops_its_processes"]  # autouse
