"""Every Lua script the store runs, each with its contract.

A script is how the store changes several keys at once: Redis runs it whole, with nothing in
between, so what it checks still holds when it writes. Each one touches the keys it is given
(KEYS), all in one slot on Redis Cluster (see schema.Layout), and reads its arguments (ARGV)
as strings. Every script here is safe to run twice: a retry after a lost reply changes
nothing more than the first run did (and, for those that count repeats, a count).

The contract of each: KEYS, ARGV, what it returns, what it guarantees. The Python that runs
it (and names its outcomes) is in the module listed with it.
"""

from __future__ import annotations

from .schema import QUEUE_CLASSES, QUOTA_TTL_MS

# A Lua function: the place (0-based) of a queue class in QUEUE_CLASSES. Scripts that act on
# the queue a request records take one key per class, in that order, and pick theirs by it.
CLASS_INDEX = (
    "local function class_index(q)\n"
    + "".join(f"  if q == '{c}' then return {i} end\n" for i, c in enumerate(QUEUE_CLASSES))
    + "  return error('unknown queue class ' .. tostring(q))\nend\n"
)

# --- a request's life (requests.py) ---------------------------------------------------------

# CREATE: persists a request and queues it, unless it exists or its queue is full.
# KEYS  req, queue:<class>, queued:<class> (of the request's shard)
# ARGV  spec (JSON), group (unused), limit (queued requests of the class in the shard),
#       class, created_ms, rid, fingerprint (what the request asks; "" not known)
# Returns {code, waiting}: 0 created, 1 existed (same fingerprint, or one not known), 2 the
#       queue is full, 3 the id is taken by another fingerprint; waiting: queued before it.
# Guarantees: a request is queued once, however often it is submitted; a repeat writes a
#       count (`submits`), so a WAIT after it covers the creation too (replication keeps
#       its order).
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local fp = redis.call('HGET', KEYS[1], 'fingerprint')
  if fp and fp ~= '' and fp ~= (ARGV[7] or '') then return {3, 0} end
  redis.call('HINCRBY', KEYS[1], 'submits', 1)
  return {1, 0}
end
local waiting = tonumber(redis.call('GET', KEYS[3]) or '0')
if waiting >= tonumber(ARGV[3]) then return {2, waiting} end
local id = redis.call('XADD', KEYS[2], '*', 'rid', ARGV[6])
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'status', 'queued', 'queue', ARGV[4],
           'entry_id', id, 'created_ms', ARGV[5], 'generated', 0, 'fingerprint', ARGV[7] or '')
redis.call('INCR', KEYS[3])
return {0, waiting}
"""

# CLAIM: moves a queued request to running on a verifier.
# KEYS  req, owned:<vid>, owners, then queued:<class> of each class (QUEUE_CLASSES order)
# ARGV  vid, admitted_ms, rid, version (the verifier's model version), pool, incarnation
# Returns 1 claimed, 0 not queued, 2 it generated tokens on another model version.
# Guarantees: one verifier claims a request at a time; a request that has generated tokens
#       is claimed only by a verifier of the version that generated them (no stream mixes
#       versions); the queued counter never goes below 0.
CLAIM = (
    CLASS_INDEX
    + """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
local version = redis.call('HGET', KEYS[1], 'version')
if version and version ~= ARGV[4]
   and tonumber(redis.call('HGET', KEYS[1], 'generated')) > 0 then return 2 end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'admitted_ms', ARGV[2],
           'version', ARGV[4], 'pool', ARGV[5], 'incarnation', ARGV[6])
local counter = KEYS[4 + class_index(redis.call('HGET', KEYS[1], 'queue'))]
if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""
)

# COMMIT: one step of a running request, by its owner.
# KEYS  req, out
# ARGV  vid, first (index of the first id), ids (comma list), n (how many), version,
#       incarnation, max_unread (0: no limit), log-probabilities ("" or a ';' list, one per
#       id; see verifier/logprobs.py)
# Returns {-1, 0} the caller no longer owns the request (it must drop it), else
#       {state, generated}: state 1 cancelled, 2 more than max_unread tokens ahead of what
#       its client was sent (`read`), 0 else (StepState); the caller goes on from
#       `generated` (after a gap, which only a Redis that lost writes leaves, it resends
#       from there).
# Guarantees: fenced by owner and incarnation (a verifier that lost the request, or an
#       earlier incarnation of one, writes nothing); only the part past `generated` is
#       appended: a retried write that went through appends nothing, one that went through
#       in part appends the rest.
COMMIT = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1]
   or (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[6] then return {-1, 0} end
local generated = tonumber(redis.call('HGET', KEYS[1], 'generated'))
local first, n = tonumber(ARGV[2]), tonumber(ARGV[4])
if generated >= first and generated < first + n then
  local ids = {}
  for t in string.gmatch(ARGV[3], '[^,]+') do ids[#ids + 1] = t end
  local skip = generated - first + 1
  local fields = {'first', generated, 'ids', table.concat(ids, ',', skip), 'v', ARGV[5]}
  if ARGV[8] ~= '' then
    local lps = {}
    for t in string.gmatch(ARGV[8], '[^;]+') do lps[#lps + 1] = t end
    fields[#fields + 1] = 'lp'
    fields[#fields + 1] = table.concat(lps, ';', skip)
  end
  redis.call('XADD', KEYS[2], '*', unpack(fields))
  generated = first + n
  redis.call('HSET', KEYS[1], 'generated', generated)
end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {1, generated} end
local limit = tonumber(ARGV[7])
local read = redis.call('HGET', KEYS[1], 'read')
if limit > 0 and read and generated - tonumber(read) > limit then return {2, generated} end
return {0, generated}
"""

# FINISH: ends a running request, by its owner.
# KEYS  req, out, queue:<class> (the request's), owned:<vid>
# ARGV  vid, status, final (JSON), completion tokens, group, rid, ttl (seconds),
#       incarnation
# Returns 1 ended (or ended before by this owner: a retry), 0 the caller does not own it
#       (someone else ends it).
# Guarantees: the final entry, the status, the queue entry's ack and deletion and the
#       owned set move together; the request's keys expire after ttl; a repeat by the owner
#       writes a count (`finishes`), so a WAIT after it covers the end too.
FINISH = """
local mine = redis.call('HGET', KEYS[1], 'owner') == ARGV[1]
   and (redis.call('HGET', KEYS[1], 'incarnation') or '') == ARGV[8]
local status = redis.call('HGET', KEYS[1], 'status')
if mine and status ~= 'running' and status ~= 'queued' and status then
  redis.call('HINCRBY', KEYS[1], 'finishes', 1)
  return 1
end
if status ~= 'running' or not mine then return 0 end
redis.call('XADD', KEYS[2], '*', 'first', ARGV[4], 'ids', '', 'final', ARGV[3])
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'final', ARGV[3])
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', KEYS[3], ARGV[5], e)
redis.call('XDEL', KEYS[3], e)
redis.call('SREM', KEYS[4], ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 1
"""

# REQUEUE: puts a running request back in its queue, keeping its progress.
# KEYS  req, owned:<vid>, then per class (QUEUE_CLASSES order) queue:<class>, then
#       queued:<class>, then requeued:<class>
# ARGV  vid, group, rid, incarnation ('*': any), admitted_ms ('*': any)
# Returns 1 requeued, 0 not running on vid (ended, requeued before, or claimed since by
#       another incarnation or again).
# Guarantees: only the claim named is requeued, never one made since; the old queue entry
#       is acked and deleted and a new one added and listed in requeued:<class>, for the
#       scheduler to place it ahead of its class; a stale member of owned:<vid> is dropped.
REQUEUE = (
    CLASS_INDEX
    + """
local n = (#KEYS - 2) / 3  -- queue classes
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  redis.call('SREM', KEYS[2], ARGV[3])
  return 0
end
if (ARGV[4] ~= '*' and (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[4])
   or (ARGV[5] ~= '*' and redis.call('HGET', KEYS[1], 'admitted_ms') ~= ARGV[5]) then
  return 0
end
local c = class_index(redis.call('HGET', KEYS[1], 'queue'))
local queue = KEYS[3 + c]
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', queue, ARGV[2], e)
redis.call('XDEL', queue, e)
local id = redis.call('XADD', queue, '*', 'rid', ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '', 'entry_id', id)
redis.call('HINCRBY', KEYS[1], 'requeues', 1)
redis.call('INCR', KEYS[3 + n + c])
redis.call('SREM', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[3 + 2 * n + c], id .. ' ' .. ARGV[3])
return 1
"""
)

# END_QUEUED: ends a queued request now (cancelled, expired, failed); or flags a running one
# for its verifier to cancel.
# KEYS  req, out, then per class (QUEUE_CLASSES order) queue:<class>, then queued:<class>
# ARGV  final (JSON), group, ttl (seconds), status, flag_running ('1': flag a running one)
# Returns {state, owner}: 0 already ended or unknown, 1 was queued (ended now), 2 running
#       (flagged if asked; owner: its verifier).
# Guarantees: a queued request ends with its final entry, its queue entry gone and its
#       queued counter down, together; a running one is ended only by its verifier.
END_QUEUED = (
    CLASS_INDEX
    + """
local n = (#KEYS - 2) / 2  -- queue classes
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', ARGV[4], 'final', ARGV[1])
  local generated = redis.call('HGET', KEYS[1], 'generated') or 0
  redis.call('XADD', KEYS[2], '*', 'first', generated, 'ids', '', 'final', ARGV[1])
  local c = class_index(redis.call('HGET', KEYS[1], 'queue'))
  local e = redis.call('HGET', KEYS[1], 'entry_id')
  redis.call('XACK', KEYS[3 + c], ARGV[2], e)
  redis.call('XDEL', KEYS[3 + c], e)
  local counter = KEYS[3 + n + c]
  if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  return {1, ''}
elseif st == 'running' and ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'cancel', 1)
  return {2, redis.call('HGET', KEYS[1], 'owner')}
end
return {0, ''}
"""
)

# --- a request's reader (outputs.py) --------------------------------------------------------

# READ: the gateway has sent the request's client this many tokens.
# KEYS  req
# ARGV  sent
# Returns 1.
# Guarantees: a request that is gone (expired) is not brought back as a bare hash.
READ = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'read', ARGV[1]) end
return 1
"""

# --- quotas of an API key (tenants.py) ------------------------------------------------------

# A Lua prelude: both buckets of a key refilled to now (they share one timestamp), kept
# QUOTA_TTL_MS (a bucket unused that long is full again). KEYS[1]: the bucket hash;
# ARGV[1-3]: now_ms, rpm, tpm. Sets locals now, rpm, tpm, req, tok.
REFILL = (
    """
local now, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local req, tok, ts = tonumber(b[1]) or rpm, tonumber(b[2]) or tpm, tonumber(b[3]) or now
local elapsed = math.max(0, now - ts)
req = math.min(rpm, req + elapsed * rpm / 60000)
tok = math.min(tpm, tok + elapsed * tpm / 60000)
redis.call('HSET', KEYS[1], 'req', req, 'tok', tok, 'ts', now)
"""
    + f"redis.call('PEXPIRE', KEYS[1], {QUOTA_TTL_MS})\n"
)

# ADMIT: opens a stream slot of a key and, for a new request, takes one request from its
# bucket; or takes nothing.
# KEYS  quota:{<key id>}, streams:{<key id>}
# ARGV  now_ms, rpm, tpm, concurrent streams allowed, stream id, stream max age (ms),
#       new request ('1'/'0')
# Returns {0, 0} admitted, else {1 requests per minute | 3 concurrent streams, retry after
#       ms} (tenants.QuotaCode).
# Guarantees: all or nothing; concurrent gateways share one limit; a slot older than the
#       max age (a dead gateway's) is freed first.
ADMIT = (
    REFILL
    + """
if ARGV[7] == '1' and req < 1 then return {1, math.ceil((1 - req) * 60000 / rpm)} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[6]))
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return {3, 1000} end
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]))
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'req', req - 1) end
return {0, 0}
"""
)

# TAKE_TOKENS: takes tokens from a key's token bucket, or nothing.
# KEYS  quota:{<key id>}
# ARGV  now_ms, rpm, tpm, tokens
# Returns {0, 0} taken, else {2 tokens per minute, retry after ms}.
TAKE_TOKENS = (
    REFILL
    + """
local want = tonumber(ARGV[4])
if tok < want then return {2, math.ceil((want - tok) * 60000 / tpm)} end
redis.call('HSET', KEYS[1], 'tok', tok - want)
return {0, 0}
"""
)

# RELEASE: ends a stream: frees its slot and gives back its unused tokens.
# KEYS  quota:{<key id>}, streams:{<key id>}
# ARGV  stream id, unused tokens, tpm (the bucket's cap)
# Returns 1.
# Guarantees: the bucket never holds more than tpm; a bucket that expired stays gone.
RELEASE = """
redis.call('ZREM', KEYS[2], ARGV[1])
local tok = tonumber(redis.call('HGET', KEYS[1], 'tok'))
if tok then
  redis.call('HSET', KEYS[1], 'tok', math.min(tonumber(ARGV[3]), tok + tonumber(ARGV[2])))
end
return 1
"""
