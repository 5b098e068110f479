"""The command line in real processes: `pagedserve keygen` writes CURVE keys, and `pagedserve
data-plane` refuses to listen off loopback without them."""
import os
import subprocess
import sys

from shared import curve
from tests.helpers import ROOT
from tests.servers import free_port


def test_keygen_writes_zmq_certificates_and_never_overwrites(tmp_path):
    folder = str(tmp_path / "k")
    cmd = [sys.executable, "-m", "control_plane.cli", "keygen", folder]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(folder)) == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert oct(os.stat(os.path.join(folder, "server.key_secret")).st_mode & 0o777) == "0o600"
    server, client = curve.load_server_keys(folder), curve.load_client_keys(folder)
    assert client.server_public == server.public and server.authorized_clients == {client.public}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "exists already" in again.stderr


def test_data_plane_process_refuses_a_public_address_without_keys(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "control_plane.cli", "data-plane", "--model", tiny_model_dir,
                          "--listen", f"tcp://0.0.0.0:{free_port()}", "--metrics-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--curve-keys" in out.stderr and "--insecure" in out.stderr and "Traceback" not in out.stderr
