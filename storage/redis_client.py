"""Redis clients from store URLs: one server, or a Redis Cluster.

URL forms:

- ``redis://[[user]:password@]host:port/db``, ``rediss://…`` (TLS), ``unix://…`` — one server,
  as redis-py's ``Redis.from_url`` reads them;
- ``redis+cluster://[[user]:password@]host:port[,host:port…]`` and ``rediss+cluster://…``
  (TLS) — a Redis Cluster, through ``redis.cluster.RedisCluster``. The listed nodes are only
  where discovery starts (any one reachable node is enough; list several so a down node
  doesn't stop a start); the port defaults to 6379. A cluster has only database 0, so the
  URL has no path beyond an optional ``/0``, and no query.
"""

from __future__ import annotations

from urllib.parse import unquote

import redis
from redis.cluster import ClusterNode, RedisCluster

from agentmem.errors import InvalidInput

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
_TIMEOUTS = {"socket_timeout": 10, "socket_connect_timeout": 5}

Client = redis.Redis | RedisCluster


def is_redis_url(url: str) -> bool:
    return url.partition("://")[0] in SCHEMES


def connect(url: str) -> Client:
    """A client for ``url``; a cluster client has discovered the cluster's slots already."""
    scheme, _, rest = url.partition("://")
    if scheme not in CLUSTER_SCHEMES:
        return redis.Redis.from_url(url, **_TIMEOUTS)
    userinfo, _, hosts = rest.rpartition("@")
    hosts, _, path = hosts.partition("/")
    if path not in ("", "0") or "?" in hosts:
        raise InvalidInput(f"Redis Cluster URL {redact(url)}: a cluster has only database 0 and takes no options")
    user, _, password = userinfo.partition(":")
    return RedisCluster(
        startup_nodes=[_node(address, url) for address in hosts.split(",")],
        username=unquote(user) or None,
        password=unquote(password) or None,
        ssl=scheme == "rediss+cluster",
        **_TIMEOUTS,
    )


def redact(url: str) -> str:
    """The URL without its credentials, for error messages."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def _node(address: str, url: str) -> ClusterNode:
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "6379")
    if not host or not port.isdigit():
        raise InvalidInput(f"Redis Cluster URL {redact(url)}: {address!r} is not host:port")
    return ClusterNode(host.strip("[]"), int(port))  # [::1]:7000 names an IPv6 node
