"""common/cluster/redis_script.py: the routing script's own connection, against real redis-servers.

It must answer exactly what redis-py answers, over every setting pdserve uses
(db, password, ACL user, unix socket; TLS in tests/integration/test_redis_security.py),
keep replies matched to requests when calls overlap or give up, and come back
by itself after a dropped connection, a timeout or a flushed script cache.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.cluster.redis_auth import redis_options
from common.cluster.redis_script import ScriptConnection, pack_command
from common.cluster.state import Cluster, NodeInfo, NodeRole
from engine.block_hash import hash_prompt_blocks
from pdserve.redis_server import RedisServer

PASSWORD = "script-password-0123456789"
HASHES = hash_prompt_blocks(list(range(16 * 40)), "m", 16)  # 40 blocks


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def run(coro):
    return asyncio.run(coro)


async def populate(cluster: Cluster, nodes: int = 4) -> None:
    for i in range(nodes):
        info = NodeInfo(f"n{i}", NodeRole.DECODE, f"127.0.0.1:{5000 + i}", "m", 16, running=i)
        await cluster.heartbeat(info, stored=HASHES[: 10 * i], reset_blocks=True)


def hits(view) -> dict[str, int]:
    return {c.node.node_id: c.hit_blocks for c in view.candidates}


async def view_through_redis_py(cluster: Cluster, hashes: list[bytes]):
    lean, cluster.route_connection = cluster.route_connection, None
    try:
        return await cluster.view(hashes)
    finally:
        cluster.route_connection = lean


def test_pack_command_is_resp():
    assert pack_command(("SET", b"k\r\n", 12)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n"


def test_it_answers_what_redis_py_answers_in_the_db_of_the_url(server):
    async def go():
        cluster = Cluster.from_url(server.url.replace("/0", "/3"), prefix="s1")
        assert cluster.route_connection is not None
        await populate(cluster)
        for n in (0, 1, 15, 40):
            lean = await cluster.view(HASHES[:n])
            slow = await view_through_redis_py(cluster, HASHES[:n])
            assert hits(lean) == hits(slow) == {f"n{i}": min(n, 10 * i) for i in range(4)}
            assert [c.node for c in lean.candidates] == [c.node for c in slow.candidates]
        assert cluster.route_connection.sent >= 4
        await cluster.close()

    run(go())


def test_password_acl_user_and_unix_socket(tmp_path):
    async def check(url: str, **auth):
        cluster = Cluster.from_url(url, redis_options(url, **auth), prefix="s2")
        assert cluster.route_connection is not None
        await populate(cluster, 2)
        assert hits(await cluster.view(HASHES)) == {"n0": 0, "n1": 10}
        await cluster.close()

    async def refused(url: str, **auth):
        cluster = Cluster.from_url(url, redis_options(url, **auth), prefix="s2")
        with pytest.raises(ResponseError, match="WRONGPASS|invalid"):
            await cluster.view(HASHES)
        await cluster.close()

    with RedisServer(password=PASSWORD) as s:
        run(check(s.url, password=PASSWORD))
        run(refused(s.url, password="wrong-password"))
    with RedisServer(password=PASSWORD, username="router") as s:
        run(check(s.url, password=PASSWORD, username="router"))
    sock = tmp_path / "redis.sock"
    with RedisServer(extra_config=[f"unixsocket {sock}", "unixsocketperm 700"]):
        run(check(f"unix://{sock}?db=2"))


def test_settings_it_does_not_handle_go_through_redis_py(server):
    import redis.asyncio as aioredis

    for extra in ({"client_name": "x"}, {"protocol": 3}):
        client = aioredis.from_url(server.url, **extra)
        assert ScriptConnection.for_client(client) is None
    assert ScriptConnection.for_client(object()) is None


def test_overlapping_calls_and_a_caller_that_gives_up_keep_replies_in_order(server):
    async def go():
        cluster = Cluster.from_url(server.url, prefix="s3")
        await populate(cluster)
        await cluster.view([])  # connected: the calls below are all written at once
        sent = cluster.route_connection.sent
        lengths = [(i * 7) % 41 for i in range(60)]
        tasks = [asyncio.ensure_future(cluster.view(HASHES[:n])) for n in lengths]
        await asyncio.sleep(0)  # every request written before any reply is read
        assert cluster.route_connection.sent == sent + 60
        for t in tasks[::3]:
            t.cancel()
        for k, (n, t) in enumerate(zip(lengths, tasks, strict=True)):
            if k % 3 == 0:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
                continue
            assert hits(await t) == {f"n{i}": min(n, 10 * i) for i in range(4)}
        assert hits(await cluster.view(HASHES[:25]))["n3"] == 25
        await cluster.close()

    run(go())


def test_it_comes_back_after_a_dropped_connection_and_a_flushed_script_cache(server):
    async def go():
        cluster = Cluster.from_url(server.url, prefix="s4")
        await populate(cluster, 2)
        await cluster.view(HASHES)
        await cluster.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        with contextlib.suppress(RedisConnectionError):
            await cluster.view(HASHES)  # may be written before the close is seen
        assert hits(await cluster.view(HASHES)) == {"n0": 0, "n1": 10}
        await cluster.redis.script_flush()  # NOSCRIPT: EVAL loads it again
        assert hits(await cluster.view(HASHES)) == {"n0": 0, "n1": 10}
        assert hits(await cluster.view(HASHES[:5])) == {"n0": 0, "n1": 5}
        await cluster.close()

    run(go())


def test_a_reply_late_beyond_the_socket_timeout_fails_and_the_next_call_reconnects(server):
    async def go():
        cluster = Cluster.from_url(server.url, prefix="s5", socket_timeout=0.2)
        await populate(cluster, 2)
        await cluster.view(HASHES)
        await cluster.redis.execute_command("CLIENT", "PAUSE", "600")
        with pytest.raises(RedisTimeoutError, match="within 0.2 s"):
            await cluster.view(HASHES)
        await asyncio.sleep(0.6)
        assert hits(await cluster.view(HASHES)) == {"n0": 0, "n1": 10}
        await cluster.close()

    run(go())


def test_a_read_started_early_gives_the_same_view_and_one_dropped_costs_nothing(server):
    async def go():
        cluster = Cluster.from_url(server.url, prefix="s6")
        await populate(cluster)
        assert cluster.start_view(HASHES) is None  # not connected yet: view() connects
        await cluster.view([])
        dropped = cluster.start_view(HASHES[:3])  # nobody finishes it
        started = cluster.start_view(HASHES[:25])
        assert dropped is not None and started is not None
        assert hits(await cluster.finish_view(started)) == {"n0": 0, "n1": 10, "n2": 20, "n3": 25}
        assert hits(await cluster.view(HASHES[:12]))["n3"] == 12
        await cluster.close()

    run(go())
