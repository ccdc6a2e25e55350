"""LoRA adapters a worker serves, as vLLM takes them (`--lora-modules`) and lists them.

- `parse_lora_module(value)`: one `--lora-modules` item, vLLM's two forms: `name=path`, or JSON
  `{"name": ..., "path": ..., "base_model_name": ...}`.
- `adapter_ids(modules)`: vLLM's lora_int_id of each adapter, 1, 2, … in load order (the ids
  KV events carry and `/v1/engine` reports).
- `adapter_cards(modules, base, created)`: the `/v1/models` entries, `parent` = the base model.

The mock has no weights: an adapter's path is only recorded (it is the card's `root`), and an
adapter changes what a request's blocks hash to, not its output.
"""

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoraModule:
    """`name=path` or vLLM's JSON form; argparse reports the ArgumentTypeError's message."""
    value = value.strip()
    if "=" in value and "," not in value and not value.startswith("{"):
        adapter, _, folder = value.partition("=")
        if not adapter or not folder:
            raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
        return LoraModule(adapter, folder)
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected NAME=PATH or JSON like "
            '{"name": "sql", "path": "/adapters/sql", "base_model_name": "my-model"}'
        ) from None
    if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"}:
        raise argparse.ArgumentTypeError(
            f"{value!r}: the JSON form takes the keys name, path and base_model_name"
        )
    name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: name and path must be non-empty strings")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"{value!r}: base_model_name must be a string")
    return LoraModule(name, path, base)


def check_modules(modules: Sequence[LoraModule], served_model_name: str) -> None:
    """Refuse adapter sets vLLM would refuse or silently shadow; ValueError says which."""
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules: the adapter {module.name!r} is given twice")
        if module.name == served_model_name:
            raise ValueError(
                f"--lora-modules: the adapter {module.name!r} has the served model's name; "
                "requests for it would reach the base model"
            )
        seen.add(module.name)


def adapter_ids(modules: Sequence[LoraModule]) -> dict[int, str]:
    return {i: module.name for i, module in enumerate(modules, 1)}


def adapter_cards(modules: Sequence[LoraModule], base: str, created: int) -> list[dict[str, Any]]:
    """vLLM lists an adapter under its base model: a `base_model_name` that is not the served
    model falls back to it, as vLLM's `load_lora_adapter` does."""
    return [
        {"id": m.name, "object": "model", "created": created, "owned_by": "dynamograph",
         "root": m.path, "parent": base, "max_model_len": None}
        for m in modules
    ]  # fmt: skip
