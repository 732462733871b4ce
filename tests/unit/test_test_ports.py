"""The test suite's port allocator (tests/conftest.py free_port): each xdist worker draws from a block of its own
below the kernel's ephemeral range, so no `bind(0)` or outgoing connection elsewhere can take a port between the
check and a server's bind."""

from __future__ import annotations

import socket

from tests.conftest import FIRST_PORT_BLOCK, GRPC_OFFSET, PORT_BLOCK_SIZE, WORKER_BLOCKS, free_port, port_block


def _ephemeral_range() -> range:
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return range(low, high + 1)


def test_blocks_are_disjoint_and_below_the_ephemeral_range_with_their_grpc_ports():
    blocks = [port_block(f"gw{n}") for n in range(WORKER_BLOCKS)] + [port_block("")]
    ports = [port for block in blocks for port in block]
    assert len(set(ports)) == len(ports) == (WORKER_BLOCKS + 1) * PORT_BLOCK_SIZE
    grpc = {port + GRPC_OFFSET for port in ports}
    assert not grpc & set(ports), "a SeaweedFS gRPC port falls in some worker's block"
    ephemeral = _ephemeral_range()
    assert max(grpc) < ephemeral.start and min(ports) == FIRST_PORT_BLOCK
    assert port_block("gw1") == port_block("gw5"), "more workers than blocks share one, not run past the range"


def test_ports_come_from_this_process_block_once_each():
    given = [free_port() for _ in range(20)]
    assert len(set(given)) == 20 and all(port in port_block() for port in given)


def test_consecutive_ports_are_reserved_together_with_their_grpc_ports_free():
    base = free_port(count=3, grpc_offset=True)
    assert all(port in port_block() for port in range(base, base + 3))
    later = {free_port() for _ in range(50)}
    assert not later & {base, base + 1, base + 2}, "a reserved port was given out again"


def test_a_busy_port_is_skipped():
    from tests import conftest

    block = port_block()
    busy = next(port for port in block if port not in conftest._given_ports and port + 1 not in conftest._given_ports
                and port + 1 < block.stop and _bindable(port) and _bindable(port + 1))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", busy))
        conftest._cursor[block.start] = busy - block.start  # the walk goes there next
        assert free_port() == busy + 1


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
