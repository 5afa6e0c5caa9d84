"""What a routing decision asks Redis: the Lua script, the node fields it reads.

One routing decision is one round trip: the script returns the server's clock
and, for every live node, its routing fields, how many leading blocks of the
request its device pool holds, and how many blocks after those its host tier
holds (``pds:host_blocks:{id}``; a node without one has no such set, and its
search costs one lookup).

The host-tier count is searched the same way from the block after the device
hit: the engine serves a host hit only where it continues the device hit
(engine/host_tier.py ``find_prefix``). Device evictions spill children before
parents and the tier evicts least recently spilled first, so what the two tiers
hold together is prefix-closed in the same sense (up to a tier too full to keep
a spill, which can only credit a node with too long a hit; hashes are hints).

That count is found by binary search: block 1, then bisection of 1..n, at
most 1 + ceil(log2(n + 1)) set lookups per node (11 for an 8k-token prompt),
one when the node holds none of it. It is exact when a node's published set
is prefix-closed -- every cached block's parent is cached too -- which the
block manager guarantees: a hit touches every block before it, and freed
blocks enter the LRU tail first, so a parent is never evicted before its child
(tests/unit/engine/test_block_manager.py checks this). Then "block i is held"
is true for i <= hit and false after it, which is what bisection needs. A set
with holes is credited with at least its leading run and at most its last
held block; hashes are hints either way, and a node verifies a block's tokens
before it reuses it.

Bisection replaced galloping (which took 2·log2(hit) lookups: fewer for hits
under about sqrt(n) blocks, twice as many for long ones). Looking up several
blocks per call with SMISMEMBER (a k-ary search) was measured and is slower:
on Redis 6.2 each block in an SMISMEMBER costs nearly as much as a call from
Lua, so the cost follows the number of blocks looked up, and bisection looks
up the fewest
(docs/lab/2026-11-25-routing-decision-second-pass.md).

Block hashes differ by the numerics of the node that computed them (its weight
quantization and KV cache dtype key them: engine/block_hash.py), so a node's
hit must be searched with the hashes its own engine computes. The caller
passes one hash list that serves every node (``ARGV[2]``; a homogeneous
cluster needs no other) and, where the nodes run several numerics, the lists
of the other classes, each under its numerics tag: the node's ``weight_dtype``
and ``kv_cache_dtype`` fields joined by NUMERICS_TAG_SEPARATOR. Only then does
the script read those two fields of each node (one HMGET more per node); a
node whose tag the caller did not list is searched with ``ARGV[2]``.

The routing fields are also written packed, as one JSON array in the hash's
``route`` field (ROUTE_FIELDS order, less ``seen_ms``), and the script reads
that one field and ``seen_ms`` instead of the 14 fields: each field read from
Lua becomes a Lua string and then a reply entry, and with 16 nodes the 14-field
read was most of the script's time on the server
(docs/lab/2026-11-25-router-own-path.md). A node hash without ``route``
(written by an earlier version) is read field by field, as before, so routers
and nodes can be upgraded in any order.

The reply is one flat array. Redis 6.2 sends each nested array of a script's
reply (a node's values, as it was) with a write() and a TCP segment of its
own: 17 for 16 nodes, where the client read the reply in as many pieces. That
cost the read time that INFO commandstats' figure for the script does not
show (docs/lab/2026-11-25-routing-decision-second-pass.md).
"""

from __future__ import annotations

from engine.block_hash import DIGEST_SIZE

# Joins a node's weight_dtype and kv_cache_dtype into its numerics tag
# (common/cluster/numerics.py), here and in the script; no dtype name holds it.
NUMERICS_TAG_SEPARATOR = "/"
# Node fields the routing script returns, in this order (NodeInfo names).
ROUTE_FIELDS = (
    "role",
    "address",
    "model_id",
    "block_size",
    "transfer_host",
    "transfer_port",
    "kv_blocks_total",
    "kv_blocks_free",
    "running",
    "waiting",
    "queued_prefill_tokens",
    "max_num_seqs",
    "draining",
    "seen_ms",
    "tensor_parallel_size",
    "max_model_len",
    "started_ms",
    "lora_adapters",
    "kv_cache_dtype",
    "lora_resident",
    "weight_dtype",
)
# The hash field holding PACKED_FIELDS as a JSON array, in that order: every
# routing field but seen_ms, which the server's clock writes by itself. A reader
# takes as many as it knows and the writer's node gave (missing ones keep their
# defaults), so new fields go at the end of ROUTE_FIELDS.
ROUTE_KEY = "route"
PACKED_FIELDS = tuple(f for f in ROUTE_FIELDS if f != "seen_ms")

# ARGV[1]: the key prefix; ARGV[2]: the request's block hashes, concatenated
# (16 bytes each). One argument rather than one per block: encoding hundreds of
# arguments cost the client more than the whole script costs the server.
# The reply is one flat array: the server's clock (ms), then per live node its
# id, the number k of values read (2: route and seen_ms; one per ROUTE_FIELDS
# field from a node without ``route``), those k values, its device hit in
# blocks, its host-tier hit in blocks after those, and 1 if an operator drained
# it (module docstring: why flat).
ROUTE_SCRIPT = """
local t = redis.call('TIME')
local out = {t[1] * 1000 + math.floor(t[2] / 1000)}
local ids = redis.call('SMEMBERS', KEYS[1])
local drained = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do drained[id] = 1 end
local prefix = ARGV[1]
local hashes = ARGV[2]
local n = math.floor(#hashes / DIGEST)
-- ARGV[3], ARGV[4]...: (numerics tag, hashes) pairs for the nodes of another
-- numerics class; ARGV[2] serves every other node (module docstring).
local default, by_tag = hashes, nil
if #ARGV > 2 then
  by_tag = {}
  for a = 3, #ARGV - 1, 2 do by_tag[ARGV[a]] = ARGV[a + 1] end
end
local function block(i) return string.sub(hashes, (i - 1) * DIGEST + 1, i * DIGEST) end
-- The last block of the run start + 1, start + 2, ... that the set holds (start: none).
local function held(key, start)
  -- Once block start + 1 is found: blocks ..lo are held, block hi is not (n + 1: past the end).
  local lo, hi = start, n + 1
  if start < n and redis.call('SISMEMBER', key, block(start + 1)) == 1 then
    lo = start + 1
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if redis.call('SISMEMBER', key, block(mid)) == 1 then lo = mid else hi = mid end
    end
  end
  return lo
end
for _, id in ipairs(ids) do
  local node = prefix .. ':node:' .. id
  local values = redis.call('HMGET', node, 'ROUTE_KEY', 'seen_ms')
  if not values[1] then  -- a node of an earlier version, or an expired one
    values = redis.call('HMGET', node, FIELDS)
  end
  if not values[1] then
    redis.call('SREM', KEYS[1], id)
  else
    if by_tag then  -- held() reads the hashes of this node's class
      local num = redis.call('HMGET', node, 'weight_dtype', 'kv_cache_dtype')
      hashes = by_tag[(num[1] or '') .. 'SEPARATOR' .. (num[2] or '')] or default
      n = math.floor(#hashes / DIGEST)
    end
    local hit = held(prefix .. ':blocks:' .. id, 0)
    local host = held(prefix .. ':host_blocks:' .. id, hit) - hit
    -- Flat: a nested table would cost a write() and a TCP segment of its own.
    out[#out + 1] = id
    out[#out + 1] = #values
    for k = 1, #values do out[#out + 1] = values[k] end
    out[#out + 1] = hit
    out[#out + 1] = host
    out[#out + 1] = drained[id] or 0
  end
end
return out
"""
ROUTE_SCRIPT = (
    ROUTE_SCRIPT.replace("ROUTE_KEY", ROUTE_KEY)
    .replace("FIELDS", ", ".join(f"'{f}'" for f in ROUTE_FIELDS))
    .replace("DIGEST", str(DIGEST_SIZE))
    .replace("SEPARATOR", NUMERICS_TAG_SEPARATOR)
)

# Stamps a heartbeat with the Redis server's clock, so that every router reads
# node ages on one clock whatever the skew between hosts.
STAMP_SCRIPT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'seen_ms', t[1] * 1000 + math.floor(t[2] / 1000))
"""
# A routing decision looks up at most this many leading blocks (64k tokens at
# block size 16), which bounds the script's arguments; a longer common prefix
# still hits on the node, which matches every block itself.
MAX_ROUTED_BLOCKS = 4096
