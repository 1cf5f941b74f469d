"""The connection to Redis: the one place that holds a Redis client.

`Connection` is the base of the store: it owns the client (one Redis or a Redis Cluster), a
second client for health checks (one try, short timeouts), the key `layout`, and the ways the
rest of the store talks through them: every shard in one round trip (`_each_shard`), a
script once per request in one round trip per node (`_pipelined`), a write acknowledged only
once replicas hold it (`_durable`, `NotReplicated`). It also answers what an operator asks of
the server (`appendonly`, `server_time`, `memory_info`) and closes the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Self

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE
from .schema import Layout

log = logging.getLogger(__name__)


class NotReplicated(redis.ConnectionError):
    """Fewer replicas than `wait_replicas` acknowledged a write in time: it is not
    acknowledged (a ConnectionError: callers treat it as Redis being away, and retry)."""


class Connection:
    """A Redis (or Redis Cluster) client, and how the store uses it."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        probe: redis.Redis | RedisCluster | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ):
        self.r = client
        self._probe = probe or client  # health checks: one try, short timeouts
        self.layout = Layout(cluster=isinstance(client, RedisCluster))
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms

    @classmethod
    def from_url(
        cls,
        url: str,
        cluster: bool = False,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        retries: int = 10,
    ) -> Self:
        """A client that rides out a short Redis outage: a command that meets a dropped
        connection is retried `retries` times with exponential backoff (with the default 10,
        about 6 s in all) before it fails.
        Every write here is safe to repeat (scripts check state; steps are written by index).
        With `cluster`, `url` names one node of a Redis Cluster (the client finds the rest and
        follows slots as they move); with `wait_replicas`, a request's creation and its end
        are acknowledged only once that many replicas hold them (`NotReplicated` if not
        within `wait_timeout_ms`)."""
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries)
        kwargs: dict[str, Any] = dict(
            decode_responses=True,
            socket_connect_timeout=2,
            socket_timeout=10,
            retry=retry,
        )
        if cluster:
            client, probe = (
                _cluster_client(url, **kwargs),
                _cluster_client(url, socket_connect_timeout=1, socket_timeout=1),
            )
        else:
            client = redis.Redis.from_url(
                url,
                health_check_interval=10,
                retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                **kwargs,
            )
            probe = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        return cls(client, probe, wait_replicas, wait_timeout_ms)

    @classmethod
    def connect(cls, settings: Any, url: str | None = None) -> Self:
        """The store a service's settings name (`redis_url` unless `url` is given,
        `redis_cluster`, `redis_wait_*`)."""
        return cls.from_url(
            url or settings.redis_url,
            cluster=settings.redis_cluster,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )

    def close(self) -> None:
        """Closes the client's connections (a later command opens them again)."""
        self.r.close()

    def wait_reachable(self, period_cap: float = 5.0) -> None:
        """Blocks until Redis answers, logging each miss: a service that starts before
        Redis waits for it (not serving meanwhile) instead of failing."""
        delay = 0.2
        while not self.ping():
            log.warning("redis unreachable; waiting", extra={"retry_in_s": delay})
            time.sleep(delay)
            delay = min(period_cap, delay * 2)

    def ping(self) -> bool:
        """True if Redis answers now (on Redis Cluster: every master)."""
        try:
            if self.layout.cluster:
                return bool(self._probe.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(self._probe.ping())
        except REDIS_ERRORS:
            return False

    # --- what an operator asks of the server ------------------------------------------------
    def appendonly(self) -> str:
        """Redis's `appendonly` setting ("yes": every write is persisted); "?" where CONFIG
        is not allowed."""
        try:
            return str(self.r.config_get("appendonly").get("appendonly", "?"))
        except redis.RedisError:
            return "?"

    def server_time(self) -> float:
        """Redis's clock, in seconds since the epoch."""
        seconds, micros = self.r.time()
        return seconds + micros / 1e6

    def memory_info(self) -> list[dict[str, Any]]:
        """INFO memory of each node that holds data (on Redis Cluster: every master)."""
        if isinstance(self.r, RedisCluster):  # (a dict per node)
            info = self.r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        else:
            info = self.r.info("memory")
        nodes = [info] if "used_memory" in info else list(info.values())
        return [n for n in nodes if isinstance(n, dict)]

    # --- how the store talks through the client -------------------------------------------
    def _each_shard(self, command: Callable[[Any, int], Any]) -> list[Any]:
        """`command(pipe, shard)` for every shard, in one round trip (per node); the replies
        in shard order."""
        pipe = self.r.pipeline(transaction=False)
        for shard in range(self.layout.shards):
            command(pipe, shard)
        return pipe.execute()

    def _durable(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Runs a script; with `wait_replicas`, then WAITs on the same connection (WAIT
        counts only the writes of its own connection) until that many replicas hold the
        writes. NotReplicated if fewer did within the timeout: the write may still be there
        (every caller's write is safe to repeat), but it was not acknowledged."""
        if not self.wait_replicas:
            return script(keys=keys, args=args)
        for attempt in (0, 1):
            if self.layout.cluster:
                node = self.r.get_node_from_key(keys[0])
                pipe = node.redis_connection.pipeline(transaction=False)
            else:
                pipe = self.r.pipeline(transaction=False)
            script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            try:
                result, acked = pipe.execute()
            except redis.exceptions.MovedError:  # the slot moved: learn where, once
                if attempt or not self.layout.cluster:
                    raise
                self.r.nodes_manager.initialize()
                continue
            if int(acked) < self.wait_replicas:
                raise NotReplicated(
                    f"{acked} of {self.wait_replicas} replicas acknowledged the write within "
                    f"{self.wait_timeout_ms} ms; retry"
                )
            return result
        raise AssertionError("unreachable")

    def _pipelined(self, script: Any, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Runs a script once per (keys, args), in one round trip per Redis node; a call
        that failed has its error in its place. (A cluster pipeline cannot carry scripts:
        the calls go on a plain pipeline to the master of their slot, and one that meets a
        moved slot or a lost master is tried once more alone, through the cluster client,
        which follows the slot.)"""
        if not self.layout.cluster:
            pipe = self.r.pipeline(transaction=False)
            for keys, args in calls:
                script(keys=keys, args=args, client=pipe)
            return pipe.execute(raise_on_error=False) if calls else []
        by_node: dict[str, tuple[Any, list[int]]] = {}
        results: list[Any] = [None] * len(calls)
        for k, (keys, _) in enumerate(calls):
            try:
                node = self.r.get_node_from_key(keys[0])
            except REDIS_ERRORS as e:
                results[k] = e
                continue
            by_node.setdefault(node.name, (node, []))[1].append(k)
        for node, ks in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            for k in ks:
                script(keys=calls[k][0], args=calls[k][1], client=pipe)
            try:
                out = pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as e:
                out = [e] * len(ks)
            for k, result in zip(ks, out, strict=True):
                results[k] = result
        for k, result in enumerate(results):
            if isinstance(result, REDIS_ERRORS):
                try:
                    results[k] = script(keys=calls[k][0], args=calls[k][1])
                except REDIS_ERRORS as e:
                    results[k] = e
        return results


class _Cluster(RedisCluster):
    """A RedisCluster client that relearns the slot map whenever a command cannot reach its
    node (at most every RELEARN_SECONDS). Its own relearning misses a path: a blocking XREAD
    to a master that died kept failing long after its replica had taken over."""

    RELEARN_SECONDS = 0.5
    _relearned = 0.0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except REDIS_UNREACHABLE:
            if time.monotonic() - self._relearned > self.RELEARN_SECONDS:
                self._relearned = time.monotonic()
                try:
                    self.nodes_manager.initialize()
                except REDIS_ERRORS:
                    pass  # no node answers yet: the next failure tries again
            raise


def _cluster_client(url: str, **kwargs: Any) -> RedisCluster:
    """A Redis Cluster client from one node's URL; waits for the cluster to answer (a service
    that starts before Redis waits for it), logging each miss."""
    delay = 0.2
    while True:
        try:
            return _Cluster.from_url(url, **kwargs)
        except REDIS_ERRORS as e:
            log.warning(
                "redis cluster unreachable; waiting", extra={"retry_in_s": delay, "error": str(e)}
            )
            time.sleep(delay)
            delay = min(5.0, delay * 2)
