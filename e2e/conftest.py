"""Both e2e suites import shared test infrastructure by package path (`e2e.*`, and the operator
tests' kmock layer as `tests.operator.emulator`): make the repository root importable however
pytest was started."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
