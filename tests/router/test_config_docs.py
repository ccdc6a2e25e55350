"""The router's configuration as documented is the one RouterConfig accepts: docs/router.md's
table is generated from the model, its example validates, and the router settings the EPP's and
the frontend's pages name are RouterConfig fields (a `weights` key once documented there was
refused by the router)."""

import re
from pathlib import Path

import pytest
import yaml

from dynamograph.protocol.router_config import RouterConfig, markdown_table

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_configuration_table_is_generated_from_the_model():
    text = (DOCS / "router.md").read_text()
    assert markdown_table() in text, (
        "docs/router.md's RouterConfig table is stale: replace it with the output of "
        "`python -m dynamograph.protocol.router_config`"
    )


def test_the_documented_example_is_a_valid_router_config():
    text = (DOCS / "router.md").read_text()
    section = text[text.index("## Configuration") :]
    example = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert example is not None
    RouterConfig.model_validate(yaml.safe_load(example.group(1)))


@pytest.mark.parametrize("page", ["epp.md", "frontend.md"])
def test_router_settings_named_in_component_pages_exist(page):
    fields = set(RouterConfig.model_fields)
    text = (DOCS / page).read_text()
    # the --config / --router-config entries list RouterConfig fields in backquotes (a table
    # row, or a list item continued on the lines after it)
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if "RouterConfig" in line and "`" in line:
            entry = [line]
            for more in lines[i + 1 :]:
                if not more.strip() or more.lstrip().startswith(("- ", "|")):
                    break
                entry.append(more)
            rows.append(" ".join(entry))
    assert rows, f"docs/{page} names no RouterConfig settings"
    named = {word for row in rows for word in re.findall(r"`([a-z_]+)`", row)}
    assert named, f"docs/{page}: no setting found in {rows}"
    unknown = named - fields
    assert not unknown, f"docs/{page} names router settings RouterConfig refuses: {unknown}"
