"""Where a process can be reached by the others: its host's address and the ports it may listen on.

A process listens for its peers in two places besides the JAX coordinator: its transfer server
(`rpegjax.runtime.transfers`: weights and rollouts between process groups) and, in process 0, the peer watch
(`rpegjax.distributed.watch`). (The transfer server's bulk transports take ephemeral ports.) Both bind to `ProcessAddress.host`: the `distributed.host_address` flag when given,
else the address this host uses to reach the coordinator (the source address of a route to it, read from the
kernel without sending anything: the interface that faces the other hosts), else 127.0.0.1 for one process.
`distributed.port_range` ("FIRST-LAST") confines the ports to a range a firewall lets through; unset, the
system picks free ones.
"""

from __future__ import annotations

import dataclasses
import socket

import jax


@dataclasses.dataclass(frozen=True)
class PortRange:
    """Ports `first` to `last` inclusive."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str, where: str) -> PortRange:
        """"FIRST-LAST" -> PortRange; ValueError naming `where` and the text when it does not parse."""
        first, dash, last = str(text).partition("-")
        if not (dash and first.strip().isdigit() and last.strip().isdigit()):
            raise ValueError(f"{where} must be 'FIRST-LAST' (e.g. 50000-50100), got {text!r}")
        low, high = int(first), int(last)
        if not 0 < low <= high < 65536:
            raise ValueError(f"{where} must be ports 1-65535 with FIRST <= LAST, got {text!r}")
        return cls(low, high)

    @property
    def size(self) -> int:
        return self.last - self.first + 1


@dataclasses.dataclass(frozen=True)
class ProcessAddress:
    """The address other processes reach this one at, and the ports it may listen on (None: any free port)."""

    host: str = "127.0.0.1"
    ports: PortRange | None = None

    def ports_for(self, slot: int, count: int) -> list[int]:
        """The `count` ports of this host's `slot`-th process (0 for the first process of its host): the range's
        first port is the peer watch's (process 0), then `count` ports per process of the host, in turn. Fixed
        rather than probed, so that processes starting together on one host never race for a port. Zeros (the system picks) without a range. Raises OSError naming the
        range when it is too small, or when something else already listens on one of the ports."""
        if self.ports is None:
            return [0] * count
        first = self.ports.first + 1 + slot * count
        ports = list(range(first, first + count))
        if ports[-1] > self.ports.last:
            raise OSError(f"distributed.port_range {self.ports.first}-{self.ports.last} is too small: process "
                          f"{jax.process_index()} is the {slot + 1}-th on {self.host} and needs {count} port(s) after the "
                          f"peer watch's; give at least "
                          f"{ports[-1] - self.ports.first + 1} ports")
        for port in ports:
            with socket.socket(_family(self.host), socket.SOCK_STREAM) as probe:
                try:  # without SO_REUSEPORT: a listener that set it still refuses this bind
                    probe.bind((self.host, port))
                except OSError as error:
                    raise OSError(f"distributed.port_range: port {port} on {self.host}, of process "
                                  f"{jax.process_index()}, is taken ({error.strerror}); choose a free range") from None
        return ports

    @property
    def watch_port(self) -> int:
        """The peer watch's port in process 0: the range's first (0 without a range: the system picks)."""
        return 0 if self.ports is None else self.ports.first


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def route_source(host: str, port: int) -> str:
    """The local address the kernel would send from to reach `host:port` (a UDP socket's connect sends
    nothing). Raises OSError naming the host when it does not resolve or has no route."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return probe.getsockname()[0]
    except OSError as error:
        raise OSError(f"cannot find this host's address towards the coordinator {host}:{port}: {error}; give it "
                      "with --distributed.host_address") from None


def process_address(host_address: str | None, coordinator_address: str | None, port_range: str | None
                    ) -> ProcessAddress:
    """This process's `ProcessAddress`: `host_address` when given, else the source address of the route to the
    coordinator ("host:port"), else 127.0.0.1 (one process)."""
    ports = None if port_range is None else PortRange.parse(port_range, "distributed.port_range")
    if host_address:
        return ProcessAddress(host_address, ports)
    if coordinator_address:
        host, _, port = coordinator_address.rpartition(":")
        return ProcessAddress(route_source(host.strip("[]"), int(port)), ports)
    if jax.process_count() > 1:
        raise ValueError("several processes but neither distributed.host_address nor a coordinator address: "
                         "give --distributed.host_address")
    return ProcessAddress("127.0.0.1", ports)
