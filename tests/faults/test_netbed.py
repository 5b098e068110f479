"""The test bed itself: hosts reach each other on their private addresses; a partition silences a
host and heal brings it back; loss drops some packets; the delay proxy holds bytes back in order;
and nothing is left behind."""
import socket
import sys
import time

import pytest

from tests.faults.netbed import NetBed, _ns_names
from tests.servers import ROOT

pytestmark = pytest.mark.faults


def connect_and_echo(address: str, port: int, payload: bytes, timeout: float) -> bytes:
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        return got


ECHO = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind((sys.argv[1],int(sys.argv[2])));s.listen()\nwhile True:\n c,_=s.accept()\n"
        " d=b''\n while (x:=c.recv(4096)): d+=x\n c.sendall(d);c.close()\n")


def wait_listening(bed, host, address, port):
    for _ in range(100):
        try:
            return bed.call_in(host, connect_and_echo, address, port, b"ping", 2.0)
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on {address}:{port}")


def test_hosts_partition_heal_loss_and_delay(tmp_path):
    with NetBed(["a", "b"]) as bed:
        tag = bed.tag
        b = bed.address["b"]
        bed.spawn("b", [sys.executable, "-c", ECHO, b, "7100"], str(tmp_path / "echo.log"))
        assert wait_listening(bed, "a", b, 7100) == b"ping"
        # host b's address is not reachable from this process's own network
        with pytest.raises(OSError):
            connect_and_echo(b, 7100, b"x", 1.0)
        bed.partition("b")
        with pytest.raises(OSError):
            bed.call_in("a", connect_and_echo, b, 7100, b"x", 1.5)
        bed.heal("b")
        assert bed.call_in("a", connect_and_echo, b, 7100, b"back", 5.0) == b"back"
        # 10% loss each way: some of the transfer's packets are dropped (it takes dozens of packets), and
        # TCP gets its bytes through
        bed.loss("b", 0.1)
        assert bed.dropped("b") == 0
        for _ in range(5):
            assert bed.call_in("a", connect_and_echo, b, 7100, b"y" * 20000, 60.0) == b"y" * 20000
        assert bed.dropped("b") > 0
        bed.heal()
        # the delay proxy in host a, in front of b's echo
        a = bed.address["a"]
        bed.spawn("a", [sys.executable, "-m", "tests.faults.delay_proxy", "--listen", f"{a}:7200", "--to",
                        f"{b}:7100", "--delay", "0.3", "--jitter", "0.05"], str(tmp_path / "proxy.log"), cwd=ROOT)
        wait_listening(bed, "a", a, 7200)
        payload = bytes(range(256)) * 400
        assert bed.call_in("a", connect_and_echo, a, 7200, payload, 10.0) == payload   # whole and in order
    assert not [ns for ns in _ns_names() if ns.startswith(tag)]
