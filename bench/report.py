"""How every benchmark reports: a rich table on stdout and a JSON file under the results folder."""

import json
import platform
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DEFAULT_RESULTS = Path("results")


def add_output_argument(parser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_RESULTS,
        help="folder for the JSON (and plots) this benchmark writes (default: ./results)",
    )


def print_table(
    title: str, columns: list[str], rows: list[list[Any]], *, width: int | None = None
) -> None:
    """`width`: at least this many columns even when stdout is not a terminal (rich's default
    there is 80, which truncates wide tables)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*(_fmt(v) for v in row))
    console = Console()
    if width is not None and console.width < width:
        console = Console(width=width)
    console.print(table)


def write_json(out: Path, name: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or "?"},
        **data,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(f"wrote {path}")
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
