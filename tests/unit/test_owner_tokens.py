"""Owner tokens kept on disk (control_plane/owner_tokens.py): saved whole and private, read back by
the next process, never by a second one while the first lives. Each OwnerTokens stands for one
process. The takeover with a saved token: tests/unit/test_ownership.py."""
import json
import os
import stat

from control_plane.owner_tokens import OwnerTokens


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
    assert not first.held_elsewhere("ipc:///x")
    second = OwnerTokens(str(tmp_path))
    assert second.load("ipc:///x") is None      # the first one lives: its lock is held
    assert second.held_elsewhere("ipc:///x")
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
