"""The network namespace and veth pair of the partition event (root and iproute2)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import subprocess


class Netns:
    """One namespace with a veth pair and a /30 of its own; removed by cleanup()."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.name = f"epchaos{tag}"
        self.host_if = f"epc{tag}h"
        self.ns_if = f"epc{tag}n"
        self.net: ipaddress.IPv4Network | None = None
        self.created = False
        self.veth = False
        self.route = False

    @staticmethod
    def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                              check=check)

    def _pick_net(self) -> ipaddress.IPv4Network:
        used = []
        out = self._ip("-4", "route", "show", "table", "all", check=False).stdout
        for line in out.splitlines():
            for tok in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in tok or tok[0].isdigit():
                        used.append(ipaddress.ip_network(tok, strict=False))
        addrs = self._ip("-4", "-o", "addr", check=False).stdout
        for m in re.finditer(r"inet (\S+)", addrs):
            used.append(ipaddress.ip_interface(m.group(1)).network)
        rng = random.Random()
        for _ in range(200):
            net = ipaddress.ip_network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}."
                                       f"{rng.randrange(0, 256, 4)}/30")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise RuntimeError("no free private /30 found")

    def setup(self) -> str:
        """Create everything; returns the upstream address inside. Raises on failure."""
        if shutil.which("ip") is None:
            raise RuntimeError("the ip command (iproute2) is not installed")
        self.net = net = self._pick_net()
        host_ip, ns_ip = (str(h) for h in net.hosts())
        self._ip("netns", "add", self.name)
        self.created = True
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self.veth = True
        self._ip("link", "set", self.ns_if, "netns", self.name)
        # If the connected route ever disappears, this keeps the /30 from leaking to the
        # default route: its traffic is refused locally instead.
        self._ip("route", "add", "unreachable", str(net), "metric", "65000")
        self.route = True
        self._ip("addr", "add", f"{host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("-n", self.name, "addr", "add", f"{ns_ip}/30", "dev", self.ns_if)
        self._ip("-n", self.name, "link", "set", self.ns_if, "up")
        self._ip("-n", self.name, "link", "set", "lo", "up")
        mac = self._ip("-n", self.name, "-br", "link", "show", self.ns_if).stdout.split()[2]
        # A permanent neighbour entry: with the peer link down, SYNs are dropped silently
        # instead of failing ARP (which would answer "no route to host" after ~1 s).
        self._ip("neigh", "replace", ns_ip, "lladdr", mac, "dev", self.host_if,
                 "nud", "permanent")
        return ns_ip

    def partition(self) -> None:
        self._ip("-n", self.name, "link", "set", self.ns_if, "down")

    def heal(self) -> None:
        self._ip("-n", self.name, "link", "set", self.ns_if, "up")

    def cleanup(self) -> None:
        if self.veth:
            self._ip("link", "del", self.host_if, check=False)
            self.veth = False
        if self.route and self.net is not None:
            self._ip("route", "del", "unreachable", str(self.net), "metric", "65000",
                     check=False)
            self.route = False
        if self.created:
            self._ip("netns", "del", self.name, check=False)
            self.created = False
