"""Key layout, Lua scripts and URL redaction of the Redis task store (`redis_store.py`).

Every key starts with the configured prefix P (default `mcp-tasks-proxy:`):

- `P task:<id>` hash: `d` the record as JSON, `v` its version (the compare-and-set field). No TTL
  while the task runs; once terminal, a TTL that ends at `terminal_ms + ttl_ms` (model's retention).
- `P idx:all`, `P idx:p:<principal key>`, `P idx:ps:<principal key>:<server key>` sorted sets
  (all scores 0, ordered by member) of `<rev>\\x1f<id>` members, where `rev` (13 digits) is
  `10**13 - 1 - created_ms`, so member order is newest first. Principal and server keys are
  SHA-256 prefixes (`model.principal_key`).
- `P live` hash: task id → owner node of every non-terminal task (the orphan sweep).
- `P live:p:<principal key>` set: the ids of one principal's non-terminal tasks, kept with `live`
  by the same scripts (SADD on a create or a non-terminal change, so tasks an older version made
  join at their next change; SREM when a task turns terminal or is purged). Its SCARD is what
  `limits.max_tasks_per_principal` caps, checked by the create script itself. A create at the cap
  first drops members whose record is gone or no longer in `live` (a key lost outside these
  scripts), so the count cannot drift up.
- `P exp` sorted set: score the expiry (epoch ms) of each terminal task with a retention,
  member `<principal key>\\x1f<server key>\\x1f<rev>\\x1f<id>`: `purge_expired` drops the index
  entries of records Redis has expired.
- `P node:<id>` string with a PX TTL: a node's lease.
- `P changes` pub/sub channel: one JSON message per committed change (see `change_message`).
- `P once:<key>`, `P blob:<key>`, `P session:<id>`: single-use claims, small blobs, the legacy
  session map (each with a PX TTL); `P limits:` the rate-limit counters of the `limits` library.

Scripts build the per-principal key names from P themselves (so this layout is for a single Redis,
not Redis Cluster). Each script is atomic: a create or a change writes the record, its indexes
and its change message in one step, and a change commits only when the version it read is
still the stored one (two writers never both win a transition).
"""

from __future__ import annotations

import json

from proxy.tasks.model import TaskRecord, principal_key

DEFAULT_PREFIX = "mcp-tasks-proxy:"
SEP = "\x1f"
_REV_BASE = 10**13 - 1  # ms; reversed creation times sort newest first
INLINE_RECORD_MAX = 64 * 1024  # bytes: records up to this size travel inside the change message


def rev(created_ms: int) -> str:
    """Reversed creation time (13 digits) so that ascending member order is newest first."""
    return f"{_REV_BASE - created_ms:013d}"


class RedisKeys:
    """The key names under `prefix`; see the module docstring."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.all = prefix + "idx:all"
        self.live = prefix + "live"
        self.expiring = prefix + "exp"
        self.changes = prefix + "changes"
        self.probe = prefix + "probe"
        self.limits = prefix + "limits"

    def task(self, task_id: str) -> str:
        """The record hash of `task_id`."""
        return f"{self.prefix}task:{task_id}"

    def by_principal(self, pkey: str) -> str:
        """The index of one principal's tasks (`pkey` = `principal_key(principal)`)."""
        return f"{self.prefix}idx:p:{pkey}"

    def live_of(self, pkey: str) -> str:
        """The set of one principal's non-terminal task ids (`pkey` = `principal_key(principal)`)."""
        return f"{self.prefix}live:p:{pkey}"

    def by_server(self, pkey: str, skey: str) -> str:
        """The index of one principal's tasks on one server (`skey` = `principal_key(server)`)."""
        return f"{self.prefix}idx:ps:{pkey}:{skey}"

    def node(self, node: str) -> str:
        """The lease key of `node`."""
        return f"{self.prefix}node:{node}"

    def once(self, key: str) -> str:
        """A single-use claim."""
        return f"{self.prefix}once:{key}"

    def blob(self, key: str) -> str:
        """A small shared value."""
        return f"{self.prefix}blob:{key}"

    def session(self, session_id: str) -> str:
        """One legacy session's entry in the session map."""
        return f"{self.prefix}session:{session_id}"

    def record_keys(self, record: TaskRecord) -> tuple[str, str, str]:
        """(index member, principal index, principal+server index) of `record`."""
        pkey, skey = principal_key(record.principal), principal_key(record.server)
        return (
            f"{rev(record.created_ms)}{SEP}{record.task_id}",
            self.by_principal(pkey),
            self.by_server(pkey, skey),
        )

    def expiry_member(self, record: TaskRecord) -> str:
        """The `exp` member of `record` (what purge needs to find its index entries)."""
        pkey, skey = principal_key(record.principal), principal_key(record.server)
        return f"{pkey}{SEP}{skey}{SEP}{rev(record.created_ms)}{SEP}{record.task_id}"


def change_message(origin: str, before: str | None, record: TaskRecord, data: str) -> str:
    """The pub/sub message of one committed change, as JSON: `o` the committing store object,
    `b` the previous status (null on create), `id`, `v` the new version, and `r` the record itself
    when its JSON (`data`) is at most INLINE_RECORD_MAX bytes (else null: receivers read it)."""
    head = json.dumps(
        {"o": origin, "b": before, "id": record.task_id, "v": record.version}, separators=(",", ":")
    )
    inline = data if len(data) <= INLINE_RECORD_MAX else "null"
    return f'{head[:-1]},"r":{inline}}}'


CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[13] ~= '' and ARGV[5] ~= '' and redis.call('EXISTS', ARGV[12] .. 'node:' .. ARGV[5]) == 0 then
  return 2
end
if ARGV[5] ~= '' and ARGV[11] ~= '' then
  local cap = tonumber(ARGV[11])
  if redis.call('SCARD', KEYS[7]) >= cap then
    for _, id in ipairs(redis.call('SMEMBERS', KEYS[7])) do
      if redis.call('HEXISTS', KEYS[5], id) == 0 or redis.call('EXISTS', ARGV[12] .. 'task:' .. id) == 0 then
        redis.call('SREM', KEYS[7], id)
      end
    end
    local live = redis.call('SCARD', KEYS[7])
    if live >= cap then return -live end
  end
end
redis.call('HSET', KEYS[1], 'd', ARGV[1], 'v', ARGV[2], 'o', ARGV[14])
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('ZADD', KEYS[3], 0, ARGV[3])
redis.call('ZADD', KEYS[4], 0, ARGV[3])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[4], ARGV[5])
  redis.call('SADD', KEYS[7], ARGV[4])
end
if ARGV[6] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('ZADD', KEYS[6], ARGV[8], ARGV[7])
end
redis.call('PUBLISH', ARGV[9], ARGV[10])
return 1
"""
"""KEYS: task, idx:all, idx:p, idx:ps, live, exp, live:p. ARGV: record JSON, version, index member,
task id, owner (or '' when terminal), ttl ms (or ''), exp member, exp score (epoch ms), channel,
message, max live tasks of the principal (or '': no cap), key prefix, '1' to require the owner's
lease (or ''), whose task it is (`owner_field`: kept as field `o`, never changed). Returns 1 when
created, 0 when the id exists, 2 when the lease is required, the record is live and its owner's
lease (`node:<owner>`) has lapsed, -n when the record is live and its principal already has
n >= the cap live tasks (nothing written in any but the first case). At the cap it reads every
member of live:p (O(cap))."""

GET_FOR = """
local o = redis.call('HGET', KEYS[1], 'o')
if o and o ~= ARGV[1] then return -1 end
return redis.call('HMGET', KEYS[1], 'd', 'v')
"""
"""KEYS: task. ARGV: the asker's `owner_field`. Returns -1 for a record that is someone else's (its
`o` field differs: the record itself is not read), else the record's `d` and `v` (nils when there
is none; a record written before `o` existed is checked by the caller)."""


def owner_field(principal_key: str, server: str) -> str:
    """The `o` field of a task hash: whose task it is (principal key and server), compared inside
    Redis so that someone else's task id costs what an unknown one does."""
    return f"{principal_key}\x1f{server}"


UPDATE = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then return -1 end
if v ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'd', ARGV[2], 'v', ARGV[3])
if ARGV[5] == '' then
  redis.call('HDEL', KEYS[2], ARGV[4])
  redis.call('SREM', KEYS[4], ARGV[4])
else
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
  redis.call('SADD', KEYS[4], ARGV[4])
end
if ARGV[6] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[7])
end
redis.call('PUBLISH', ARGV[9], ARGV[10])
return 1
"""
"""KEYS: task, live, exp, live:p. ARGV: expected version, record JSON, new version, task id, owner (or ''
when terminal), ttl ms (or ''), exp member, exp score, channel, message. Returns -1 when the
record is gone, 0 when another writer changed it first (nothing written), 1 when committed."""

PURGE = """
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, m in ipairs(items) do
  local pk, sk, rv, id = string.match(m, '^([^\\31]*)\\31([^\\31]*)\\31([^\\31]*)\\31(.*)$')
  if id then
    local member = rv .. '\\31' .. id
    redis.call('ZREM', KEYS[2], member)
    redis.call('ZREM', ARGV[3] .. 'idx:p:' .. pk, member)
    redis.call('ZREM', ARGV[3] .. 'idx:ps:' .. pk .. ':' .. sk, member)
    redis.call('DEL', ARGV[3] .. 'task:' .. id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('SREM', ARGV[3] .. 'live:p:' .. pk, id)
  end
  redis.call('ZREM', KEYS[1], m)
end
return #items
"""
"""KEYS: exp, idx:all, live. ARGV: now (epoch ms), batch size, key prefix. Forgets up to a batch
of records whose retention ended (record, index and live entries); returns how many."""
