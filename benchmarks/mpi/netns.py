"""Two hosts on one machine: network namespaces, each with its own interface, address and host
name, joined by veth pairs through a bridge, so that MPI ranks started in them talk over TCP and
never through shared memory. The two-host tests (tests/test_mpi_hosts.py) and the overlap
benchmark (mpi_hosts.py) run on them; making them needs root and iproute2.

The launcher that enters a namespace, in the place of ssh, is tests/programs/netns_launch.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "tests" / "programs" / "netns_launch"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Two namespaces h1, h2 at 10.X.Y.1 and .2, a bridge at .254 (where mpiexec listens)."""

    def __init__(self):
        tag = f"tbp{os.getpid() % 10000}"
        self.bridge, self.ns = f"{tag}br", [f"{tag}h1", f"{tag}h2"]
        self.veth = [f"{tag}v1", f"{tag}v2"]
        net = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
        self.ips = [f"{net}.1", f"{net}.2"]
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{net}.254/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for ns, veth, addr in zip(self.ns, self.veth, self.ips):
                ip("netns", "add", ns)
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("link", "set", veth, "master", self.bridge, "up")
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self):
        for ns, veth in zip(self.ns, self.veth):
            ip("netns", "del", ns, check=False)
            ip("link", "del", veth, check=False)
        ip("link", "del", self.bridge, check=False)

    def sent(self, host: int) -> int:
        """Bytes host (0 or 1) has sent over its link."""
        return int(subprocess.run(["ip", "netns", "exec", self.ns[host], "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                                  capture_output=True, text=True, check=True).stdout)

    def link(self, host: int, up: bool):
        ip("link", "set", self.veth[host], "up" if up else "down")

    def shape(self, gbit: float | None):
        """Hold what each host sends to ``gbit`` Gbit/s (a token bucket on its interface, so both
        directions are limited); None lifts the limit."""
        for ns in self.ns:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=30)
            if gbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                "rate", f"{gbit * 1000:g}mbit", "burst", f"{max(64, int(gbit * 256))}kb",
                                "latency", "100ms"], capture_output=True, text=True, check=True, timeout=30)

    def command(self, mpiexec: str, args, ranks: int = 2) -> list[str]:
        """mpiexec over the two hosts, one rank each (``ranks`` in all), running python ARGS."""
        return [mpiexec, "-hosts", ",".join(self.ips), "-n", str(ranks), "-launcher", "ssh", "-launcher-exec",
                str(LAUNCH), "-iface", self.bridge, sys.executable, *map(str, args)]

    # UCX would find the other rank's memory through /dev/shm, which the namespaces share; real
    # machines share none, so TCP it is
    ENV = {"UCX_TLS": "tcp,self"}
