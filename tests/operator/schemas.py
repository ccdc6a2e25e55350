"""Validate objects against a CRD's openAPIV3Schema with jsonschema, as strictly as possible.

A CRD schema is OpenAPI v3.0 (Draft 4 style: boolean `exclusiveMinimum`, `x-kubernetes-*`
extensions that jsonschema ignores). The apiserver *prunes* unknown fields instead of refusing
them; for tests a typo must fail, so `strict_schema` forbids properties a node does not declare
(unless it says `x-kubernetes-preserve-unknown-fields`). CEL rules are not evaluated here.
"""

import copy
from typing import Any

import jsonschema


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            visit(value)

    visit(schema)
    return schema


def crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return strict_schema(entry["schema"]["openAPIV3Schema"])
    raise KeyError(f"{crd['metadata']['name']} has no version {version}")


def validate_against_crd(obj: dict[str, Any], crd: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `obj` does not fit its CRD's schema."""
    group = crd["spec"]["group"]
    api_group, _, version = obj["apiVersion"].rpartition("/")
    assert api_group == group, f"{obj['apiVersion']} is not in group {group}"
    assert obj["kind"] == crd["spec"]["names"]["kind"]
    schema = crd_schema(crd, version)
    # metadata is validated by the apiserver, not by the CRD's schema.
    body = {k: v for k, v in obj.items() if k != "metadata"}
    jsonschema.Draft4Validator(schema).validate(body)
