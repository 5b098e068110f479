"""Owner tokens kept on disk (control_plane/owner_tokens.py): a control plane started again takes
its data plane over at once with the token its previous run saved, even while the old link still
looks up; a second control plane while the first runs cannot use the token and is refused. A real
Worker loop in a thread and real DataPlaneClients; each OwnerTokens stands for one process."""
import asyncio
import json
import os
import stat
import threading

import pytest

from control_plane.dp_client import DataPlaneClient, DataPlaneRefused
from control_plane.owner_tokens import OwnerTokens
from data_plane.worker import Worker
from shared import protocol as P
from tests.helpers import StubRunner
from tests.servers import free_port


@pytest.fixture
def worker():
    w = Worker(StubRunner(), f"tcp://127.0.0.1:{free_port()}")
    thread = threading.Thread(target=w.serve_forever, daemon=True)
    thread.start()
    yield w
    async def stop():   # as its owner would
        c = DataPlaneClient(w.listen)
        c.token = w.owner_token
        await c.handshake(5)
        await c.shutdown()
        await asyncio.sleep(0.2)
        c.close()
    asyncio.run(stop())
    thread.join(5)
    assert not thread.is_alive()


def test_the_token_is_saved_whole_and_private(tmp_path):
    tokens = OwnerTokens(str(tmp_path / "state"))
    tokens.save("tcp://10.0.0.2:5555", "abc")
    [path] = [p for p in (tmp_path / "state").iterdir() if p.suffix == ".json"]
    assert json.loads(path.read_text()) == {"address": "tcp://10.0.0.2:5555", "token": "abc"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.endswith(".tmp")]
    tokens.close()
    again = OwnerTokens(str(tmp_path / "state"))
    assert again.load("tcp://10.0.0.2:5555") == "abc" and again.load("tcp://10.0.0.3:5555") is None
    again.close()


def test_a_live_holder_keeps_the_token_from_a_second_process(tmp_path):
    first = OwnerTokens(str(tmp_path))
    first.save("ipc:///x", "abc")
    second = OwnerTokens(str(tmp_path))
    assert second.load("ipc:///x") is None      # the first one lives: its lock is held
    second.save("ipc:///x", "mine")             # and the second cannot overwrite it
    first.close()
    third = OwnerTokens(str(tmp_path))
    assert third.load("ipc:///x") == "abc"
    third.close()
    second.close()


def test_an_unreadable_token_file_is_ignored(tmp_path):
    tokens = OwnerTokens(str(tmp_path))
    tokens.save("ipc:///x", "abc")
    [path] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    tokens.close()
    path.write_text("{not json")
    again = OwnerTokens(str(tmp_path))
    assert again.load("ipc:///x") is None
    again.close()


def test_a_state_dir_that_cannot_be_made_keeps_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    tokens = OwnerTokens(str(tmp_path / "file" / "state"))
    assert not tokens.usable and tokens.load("ipc:///x") is None
    tokens.save("ipc:///x", "abc")
    assert os.listdir(tmp_path) == ["file"]


def test_a_restarted_control_plane_takes_over_at_once_and_a_second_live_one_is_refused(worker, tmp_path):
    state = str(tmp_path)

    async def run():
        run1 = OwnerTokens(state)
        old = DataPlaneClient(worker.listen, tokens=run1)
        token = (await old.handshake(5)).owner_token
        assert (await old.step(P.StepPlan(1), 5)).step_id == 1
        # a second control plane on this host while the first runs: it cannot read the token, and
        # the data plane refuses it (no grace: the owner's link is up)
        rival = DataPlaneClient(worker.listen, tokens=OwnerTokens(state))
        assert rival.token is None
        with pytest.raises(DataPlaneRefused, match="already serves another control plane"):
            await rival.handshake(5, refusal_grace=0.0)
        rival.close()
        # the first one dies in a way its link does not show yet (a frozen or cut-off host): its
        # socket stays open, only its process's lock is gone
        run1.close()
        run2 = OwnerTokens(state)
        restarted = DataPlaneClient(worker.listen, tokens=run2)
        assert restarted.token == token
        hs = await restarted.handshake(5, refusal_grace=0.0)   # taken over at the first HELLO
        assert hs.owner_token == token
        assert (await restarted.step(P.StepPlan(2), 5)).step_id == 2
        with pytest.raises(DataPlaneRefused):   # the old socket lost the data plane
            await old.step(P.StepPlan(3), 5)
        old.close()
        restarted.close()
        run2.close()
    asyncio.run(run())
    assert [p.step_id for p in worker.runner.plans] == [1, 2]
