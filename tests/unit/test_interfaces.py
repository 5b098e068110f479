"""control_plane/serving.py: the engine, the router and the ZeroMQ client have every member of the
interface they stand for, with the same parameters."""
import inspect

import pytest

from control_plane.dp_client import DataPlaneClient
from control_plane.router import Router
from control_plane.serving import DataPlaneLink, ServingEngine
from tests.helpers import small_engine


def members(protocol) -> dict[str, object]:
    """Each member the protocol names: its attributes (None) and its methods and properties."""
    found = {name: None for name in protocol.__annotations__}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (callable(value) or isinstance(value, property)):
            found[name] = value
    return found


def check(obj, protocol) -> None:
    for name, declared in members(protocol).items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if callable(declared) and not isinstance(declared, property):
            want = list(inspect.signature(declared).parameters)[1:]
            got = list(inspect.signature(getattr(obj, name)).parameters)
            assert got[:len(want)] == want, f"{type(obj).__name__}.{name}{got} against {want}"


def test_engine_and_router_serve_the_api():
    engine = small_engine()   # the members are checked, nothing runs: no model needed
    check(engine, ServingEngine)
    check(Router([engine]), ServingEngine)
    assert len(members(ServingEngine)) >= 14


def test_the_zeromq_client_is_a_data_plane_link():
    client = DataPlaneClient("tcp://127.0.0.1:1")
    try:
        check(client, DataPlaneLink)
    finally:
        client.close()


def test_a_missing_member_is_reported():
    class Half:
        config = tokenizer = stats = draining = None
    with pytest.raises(AssertionError, match="lacks ServingEngine"):
        check(Half(), ServingEngine)


def test_the_in_process_link_is_a_data_plane_link():
    from tests.runner_link import RunnerLink, Unreachable
    check(RunnerLink(Unreachable(None)), DataPlaneLink)
