"""Several "hosts" on one machine, for fault tests: Linux network namespaces joined by veth pairs
on a bridge, each host with a private address, and the faults a network between machines has.

    with NetBed(["a", "b", "c"]) as bed:
        proc = bed.spawn("b", ["python", "-m", ...], log_path)   # runs inside host b
        bed.partition("b")          # host b hears nothing and is heard by no one (iptables DROP)
        bed.heal("b")
        bed.loss("b", 0.05)         # 5% of b's packets dropped, each way (iptables' statistic match)
        bed.call_in("a", fn)        # fn runs in a thread whose sockets are host a's

The bridge lives in a namespace of its own, so nothing is added to the machine's own network, and
no address outside 10.77.0.0/24 on these links is used. Everything made (namespaces, the processes
started in them) is removed on exit, also after a failure; a bed left by a process that died is
removed by the next one. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): without it, NetBed raises
NetBedError, which says so. Delay and jitter come from tests/faults/delay_proxy.py (the kernel
here has no netem qdisc).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import signal
import subprocess
import threading
import time

PREFIX = "psf"           # namespace names: psf<pid>-<host>, and psf<pid>-sw for the bridge
SUBNET = "10.77.0"       # host i (from 0) is SUBNET.(i + 1)/24
CLONE_NEWNET = 0x40000000


class NetBedError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _ns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_ns_processes(ns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale_beds() -> None:
    """Namespaces of a bed whose process is gone (killed before its cleanup ran)."""
    for ns in _ns_names():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _kill_ns_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def check_root() -> None:
    """Raises NetBedError unless this process can make namespaces and iptables rules."""
    if os.geteuid() != 0:
        raise NetBedError("the fault tests need root (network namespaces, veth pairs, iptables): run them as "
                          "root, as CI does")
    for tool in ("ip", "iptables"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise NetBedError(f"the fault tests need '{tool}' (apt-get install iproute2 iptables)")


class NetBed:
    def __init__(self, hosts: list[str]):
        check_root()
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 200:
            raise NetBedError(f"hosts must be 1 to 200 distinct names, got {hosts}")
        self.hosts = list(hosts)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.address = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self.procs: list[subprocess.Popen] = []
        self._rules: dict[str, list[list[str]]] = {h: [] for h in hosts}   # iptables rules in force per host
        self._made: list[str] = []
        remove_stale_beds()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        if host not in self.address:
            raise NetBedError(f"no host {host!r} in this bed (hosts: {', '.join(self.hosts)})")
        return f"{self.tag}-{host}"

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # --- processes -----------------------------------------------------------------------------
    def spawn(self, host: str, cmd: list[str], log_path: str, env: dict | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        """Starts `cmd` inside `host`, its output appended to `log_path`, in a session of its own."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def call_in(self, host: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a thread whose sockets are `host`'s; returns what it returns."""
        return self.start_in(host, fn, *args, **kwargs).result()

    def start_in(self, host: str, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Like call_in, without waiting: a Future of fn's result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        path = f"/var/run/netns/{self.ns(host)}"

        def run():
            try:
                _enter_netns(path)
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:   # handed to whoever waits on the future
                future.set_exception(exc)
        threading.Thread(target=run, daemon=True, name=f"in-{host}").start()
        return future

    # --- faults --------------------------------------------------------------------------------
    def _iptables(self, host: str, *rule: str, add: bool) -> None:
        cmd = ["ip", "netns", "exec", self.ns(host), "iptables", "-w", "-I" if add else "-D", *rule]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def _add_rules(self, host: str, rules: list[list[str]]) -> None:
        for rule in rules:
            self._iptables(host, *rule, add=True)
            self._rules[host].append(rule)

    def partition(self, host: str, peers: list[str] | None = None) -> None:
        """Drops every packet between `host` and `peers` (default: every other host), both ways.
        TCP connections stay open and go silent, as behind a broken switch."""
        peers = [p for p in (peers or self.hosts) if p != host]
        rules = []
        for peer in peers:
            rules += [["INPUT", "-s", self.address[peer], "-j", "DROP"],
                      ["OUTPUT", "-d", self.address[peer], "-j", "DROP"]]
        self._add_rules(host, rules)

    def loss(self, host: str, probability: float) -> None:
        """Drops each packet `host` sends or receives with `probability` (TCP retransmits them)."""
        if not 0 < probability < 1:
            raise NetBedError(f"a loss probability is in (0, 1), got {probability}")
        p = f"{probability:.4f}"
        self._add_rules(host, [[chain, "-o" if chain == "OUTPUT" else "-i", "eth0", "-m", "statistic", "--mode",
                                "random", "--probability", p, "-j", "DROP"] for chain in ("INPUT", "OUTPUT")])

    def dropped(self, host: str) -> int:
        """Packets the DROP rules of `host` dropped so far (iptables' counters)."""
        out = subprocess.run(["ip", "netns", "exec", self.ns(host), "iptables", "-w", "-L", "-v", "-x", "-n"],
                             check=True, capture_output=True, text=True).stdout
        return sum(int(line.split()[0]) for line in out.splitlines()
                   if line.split()[2:3] == ["DROP"] and line.split()[0].isdigit())

    def heal(self, host: str | None = None) -> None:
        """Removes the partitions and losses of `host` (default: every host)."""
        for h in [host] if host else self.hosts:
            while self._rules[h]:
                self._iptables(h, *self._rules[h].pop(), add=False)

    # --- cleanup -------------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            _kill_ns_processes(ns)     # anything else started in it
            for _ in range(50):        # a namespace is busy until its last process is reaped
                if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
        self._made.clear()

    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _enter_netns(path: str) -> None:
    """Moves the calling thread (only it) into the network namespace at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetBedError(f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)
