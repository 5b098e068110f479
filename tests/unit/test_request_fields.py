"""Request field names, deadlines and limits are checked before anything is queued; the published
OpenAPI document is the one the server enforces."""
import json
import os

import pytest

from control_plane.api_schema import (IGNORED_PROPERTIES, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, chat_schema,
                                      check_fields, completion_schema)
from control_plane.openapi import openapi_spec
from control_plane.sampling_params import ValidationError, flag, parse_sampling, parse_timeout
from shared.config import ConfigError, ControlPlaneConfig, DataPlaneConfig
from shared.curve import is_loopback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rejected(body, chat=False) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        check_fields(body, chat)
    return info.value


def test_unknown_fields_are_named_in_the_error():
    err = rejected({"prompt": "hi", "max_tokns": 5, "temprature": 0})
    assert err.code == "unknown_field" and err.param == "max_tokns"
    assert "'max_tokns'" in err.message and "'temprature'" in err.message and "remove" in err.message
    # a chat field is unknown on the completions endpoint, and the other way round
    assert rejected({"prompt": "hi", "messages": []}).param == "messages"
    assert rejected({"messages": [], "prompt": "hi"}, chat=True).param == "prompt"
    err = rejected({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, chat=True)
    assert err.code == "unknown_field" and "'tool_call_id'" in err.message and "messages[0]" in err.message


@pytest.mark.parametrize("chat,name,value", [(False, "logit_bias", {"50": 10}), (False, "echo", True),
                                             (False, "suffix", "end"), (False, "echo", 0),
                                             (True, "tools", [{"type": "function"}]),
                                             (True, "response_format", {"type": "json_object"})])
def test_unsupported_openai_fields_get_400_unless_neutral(chat, name, value):
    err = rejected({name: value}, chat)
    assert err.code == "unsupported_parameter" and err.param == name and "not supported" in err.message


def test_neutral_and_ignored_fields_are_accepted():
    check_fields({"prompt": "hi", "echo": False, "logit_bias": {}, "suffix": None, "user": "u",
                  "stream_options": {"include_usage": True}}, chat=False)
    check_fields({"messages": [{"role": "user", "content": "x", "name": "ann"}], "tools": [], "tool_choice": "none",
                  "response_format": {"type": "text"}, "store": False, "metadata": {"a": "b"}}, chat=True)
    err = rejected({"prompt": "hi", "user": 5})
    assert err.code == "invalid_type" and err.param == "user"


@pytest.mark.parametrize("chat", [False, True])
def test_every_field_of_the_published_schema_passes_the_name_check(chat):
    spec = openapi_spec()["components"]["schemas"]["ChatCompletionRequest" if chat else "CompletionRequest"]
    assert spec["additionalProperties"] is False
    check_fields({name: None for name in spec["properties"]}, chat)
    unsupported = UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION
    assert not set(unsupported) & set(spec["properties"])
    assert set(IGNORED_PROPERTIES) <= set(spec["properties"])


def test_docs_copy_of_the_openapi_document_is_current():
    with open(os.path.join(ROOT, "docs", "openapi.json")) as f:
        assert json.load(f) == json.loads(json.dumps(openapi_spec())), \
            "docs/openapi.json is stale: python -m control_plane.openapi > docs/openapi.json"


def test_n_and_best_of_beyond_the_limit_say_what_the_limit_is():
    for name in ("n", "best_of"):
        with pytest.raises(ValidationError) as info:
            parse_sampling({name: 5}, max_n=4)
        assert info.value.param == name and "limit of 4" in info.value.message and "--max-n" in info.value.message
    assert parse_sampling({"n": 4}, max_n=4).n == 4
    assert completion_schema(max_n=4)["properties"]["n"]["maximum"] == 4
    assert chat_schema(max_n=7)["properties"]["best_of"]["maximum"] == 7


def test_timeout_is_capped_by_the_server_limit():
    assert parse_timeout({}, None) is None
    assert parse_timeout({}, 30.0) == 30.0
    assert parse_timeout({"timeout": 2}, None) == 2.0
    assert parse_timeout({"timeout": 90}, 30.0) == 30.0
    assert parse_timeout({"timeout": 5}, 30.0) == 5.0
    for bad in (0, -1, "5", True):
        with pytest.raises(ValidationError) as info:
            parse_timeout({"timeout": bad}, None)
        assert info.value.param == "timeout"


def test_flags_take_null_as_false_and_reject_other_types():
    assert flag({"stream": None}, "stream") is False and flag({}, "stream") is False
    assert flag({"stream": True}, "stream") is True
    with pytest.raises(ValidationError):
        flag({"stream": 1}, "stream")
    with pytest.raises(ValidationError):
        parse_sampling({"early_stopping": 1})


def test_loopback_addresses():
    assert all(is_loopback(a) for a in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:2",
                                        "ipc:///tmp/x.sock", "inproc://a"))
    assert not any(is_loopback(a) for a in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5",
                                            "tcp://eth0:5555"))


@pytest.fixture
def model_dir(tmp_path) -> str:
    """The settings check only that a model folder exists; an empty one spares building a model."""
    folder = tmp_path / "model"
    folder.mkdir()
    return str(folder)


def test_data_plane_refuses_to_listen_off_loopback_without_keys(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="--curve-keys"):
        DataPlaneConfig(model=model_dir, listen="tcp://0.0.0.0:5555").validate()
    DataPlaneConfig(model=model_dir, listen="tcp://0.0.0.0:5555", insecure=True).validate()
    DataPlaneConfig(model=model_dir, listen="tcp://127.0.0.1:5555").validate()
    with pytest.raises(ConfigError, match="keygen"):
        DataPlaneConfig(model=model_dir, listen="tcp://0.0.0.0:5555", curve_keys=str(tmp_path)).validate()


def test_control_plane_settings_are_checked(model_dir, tmp_path):
    ControlPlaneConfig(model=model_dir).validate()     # so each error below comes from its bad setting
    for bad in ({"max_n": 0}, {"request_timeout": 0}, {"shutdown_grace": -1}, {"curve_keys": str(tmp_path / "no")}):
        with pytest.raises(ConfigError):
            ControlPlaneConfig(model=model_dir, **bad).validate()
