"""Evaluate a CRD's `x-kubernetes-validations` (CEL) rules on an object, with cel-python.

The apiserver runs these rules; no apiserver runs here, so the tests evaluate them with PyPI
`cel-python`: every rule of our own CRD must compile (a rule that does not compile makes the CRD
uninstallable) and must agree with the pydantic validators. Upstream CRDs use Kubernetes' CEL
extension functions (e.g. `isURL`) that cel-python lacks; `evaluate(..., strict=False)` skips
those rules and reports how many it skipped. Transition rules (`oldSelf`) are skipped: there is
no old object on create.
"""

from dataclasses import dataclass, field
from typing import Any

import celpy


@dataclass
class Outcome:
    failures: list[tuple[str, str]] = field(default_factory=list)  # (path, message)
    evaluated: int = 0
    skipped: int = 0


_env = celpy.Environment()


def _program(rule: str):
    return _env.program(_env.compile(rule))


def evaluate(schema: dict[str, Any], value: Any, *, strict: bool = True) -> Outcome:
    outcome = Outcome()
    _walk(schema, value, "", outcome, strict)
    return outcome


def _walk(schema: dict[str, Any], value: Any, path: str, out: Outcome, strict: bool) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            out.skipped += 1
            continue
        try:
            result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(result, Exception):
                raise result
        except Exception:
            if strict:
                raise
            out.skipped += 1
            continue
        out.evaluated += 1
        if not bool(result):
            out.failures.append(
                (path + rule.get("fieldPath", ""), rule.get("message", rule["rule"]))
            )
    if isinstance(value, dict):
        for name, child in (schema.get("properties") or {}).items():
            if name in value:
                _walk(child, value[name], f"{path}.{name}", out, strict)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, child_value in value.items():
                _walk(extra, child_value, f"{path}.{name}", out, strict)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            _walk(schema["items"], item, f"{path}[{index}]", out, strict)
