"""nvext models: the seed's field names and defaults, omit-None output, errors that name the field."""

import pytest

from dynamograph.protocol.nvext import (
    NvExt,
    NvExtError,
    NvExtResponse,
    SessionAction,
    SessionControl,
    WorkerIdInfo,
    parse_nvext,
)

pytestmark = pytest.mark.unit


def test_defaults_are_all_none_and_serialise_to_empty():
    assert NvExt().model_dump() == {}
    assert NvExt().model_dump_json() == "{}"


def test_session_control_seed_cases():
    sc = SessionControl.model_validate({"session_id": "sub-1", "action": "open", "timeout": 60})
    assert (sc.action, sc.timeout) == (SessionAction.OPEN, 60)
    assert SessionControl.model_validate({"session_id": "s", "action": "close"}).timeout == 300
    assert SessionControl.model_validate({"session_id": "s"}).action is None
    roundtrip = SessionControl(session_id="t", action=SessionAction.CLOSE, timeout=90)
    assert SessionControl.model_validate_json(roundtrip.model_dump_json()) == roundtrip


def test_full_nvext_parses():
    nvext = parse_nvext(
        {
            "backend_instance_id": 42,
            "token_data": [1, 2, 3],
            "extra_fields": ["worker_id", "timing"],
            "prefill_worker_id": 100,
            "decode_worker_id": 200,
            "agent_hints": {"priority": 2, "osl": 128},
            "session_control": {"session_id": "sub-2", "action": "open"},
        }
    )
    assert nvext.wants("worker_id") and nvext.wants("timing") and not nvext.wants("other")
    assert nvext.agent_hints.osl == 128


def test_response_omits_none():
    response = NvExtResponse(worker_id=WorkerIdInfo(decode_worker_id=5, decode_dp_rank=0))
    assert response.model_dump() == {"worker_id": {"decode_worker_id": 5, "decode_dp_rank": 0}}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"backend_instance_id": -1}, r"nvext\.backend_instance_id: .*\(got -1\)"),
        ({"dp_rank": "two"}, r"nvext\.dp_rank: .*\(got 'two'\)"),
        ({"dp_rank": 1 << 32}, r"nvext\.dp_rank: .*\(got 4294967296\)"),
        ({"agent_hints": {"osl": "long", "future": 1}}, r"nvext\.agent_hints\.osl: .*'long'"),
        (
            {"session_control": {"action": "open"}},
            r"nvext\.session_control\.session_id: Field required",
        ),
        (
            {"session_control": {"session_id": "s", "action": "pause"}},
            r"nvext\.session_control\.action: .*'pause'",
        ),
        ({"token_data": [1, -2]}, r"nvext\.token_data\.1: .*\(got -2\)"),
    ],
)
def test_errors_name_field_and_value(value, message):
    with pytest.raises(NvExtError, match=message):
        parse_nvext(value)


def test_unknown_fields_are_ignored_as_dynamo_does():
    """Dynamo's serde structs have no deny_unknown_fields: a newer client's keys are dropped."""
    nvext = parse_nvext(
        {
            "future_hint": 5,
            "agent_hints": {"osl": 9, "new": "x"},
            "session_control": {"session_id": "s", "later": True},
        }
    )
    assert nvext.agent_hints.osl == 9 and nvext.session_control.session_id == "s"
    assert nvext.model_dump() == {
        "agent_hints": {"osl": 9},
        "session_control": {"session_id": "s", "timeout": 300},
    }


def test_nvext_must_be_an_object():
    with pytest.raises(NvExtError, match="nvext must be a JSON object, got list"):
        parse_nvext([1])
    assert parse_nvext(None) is None
