"""The throwaway store servers the suites start: a port taken between choosing and binding it
must not fail a suite (the flake that cost CI a run), and a restart keeps its port."""

from __future__ import annotations

import socket

import pytest

from agentmem.errors import StoreUnavailable
from servers.local_redis import LocalRedis, LocalRedisCluster


def _holding(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` (0: one the OS chooses) and not listening: what an outgoing
    connection's ephemeral port looks like to a server that wants to bind it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    return holder


def test_a_first_start_moves_off_a_port_taken_since_it_was_chosen(tmp_path):
    with _holding() as holder:
        server = LocalRedis(tmp_path / "redis")
        taken = holder.getsockname()[1]
        server.port = taken  # as if free_port() had answered just before another process bound it
        with server:
            assert server.port != taken
            with server.client() as client:
                assert client.ping()


def test_a_restart_keeps_its_port_and_a_taken_port_is_an_error_that_quotes_the_log(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    port = server.port
    server.stop()
    with _holding(port):
        with pytest.raises(StoreUnavailable, match=f"(?s)did not start on port {port}; its log ends:.*already in use"):
            server.start(timeout=5)
    server.start()  # the port is free again: the same URL serves once more
    assert server.port == port
    server.stop()


@pytest.mark.slow
def test_a_cluster_whose_bus_port_is_taken_is_built_again_on_fresh_ports(tmp_path):
    cluster = LocalRedisCluster(tmp_path / "cluster")
    bus_port = int(cluster.nodes[0].extra_args[cluster.nodes[0].extra_args.index("--cluster-port") + 1])
    with _holding(bus_port), cluster:
            assert bus_port not in {int(n.extra_args[n.extra_args.index("--cluster-port") + 1]) for n in cluster.nodes}
            cluster.flush()
            for node in cluster.nodes:
                with node.client() as client:
                    assert client.cluster("info")["cluster_state"] == "ok"


def test_a_postgres_server_moves_off_a_port_taken_since_it_was_chosen():
    from servers.local_postgres import LocalPostgres

    with _holding() as holder:
        server = LocalPostgres()
        taken = holder.getsockname()[1]
        server.port = taken
        with server:
            assert server.port != taken
            url = server.create_database("moved")
            assert f":{server.port}/moved" in url
