"""The queue's Lua steps. Each runs atomically in Redis; the comment above each says what it
makes atomic, and why that matters. Entry fields come from ``entries`` (``xadd_lua``), so the
Python that reads entries and every script that writes them agree on one layout.

A request's binding (``Keys.request``) holds ``"<fingerprint> <submission>"``: what the id is
bound to, and the submission that queued it (cancelled by ``FORGET_BINDING_LUA``). Its helpers
(``BINDING_LUA``) and the waiter count's (``WAITERS_LUA``) are also the router's enqueue
step's, so each format is written here only.
"""

from __future__ import annotations

from string import Template

from redis.asyncio import Redis

from rlfleet.common.queue.entries import PRIOR, WEIGHT, xadd_lua

# Lua prelude: is a binding someone else's (another fingerprint)? / bind an id to content.
BINDING_LUA = """local function bound_elsewhere(bound, fingerprint)
  return bound and string.sub(bound, 1, #fingerprint + 1) ~= fingerprint .. ' '
end
local function bind(binding, fingerprint, submission, ttl)
  redis.call('SET', binding, fingerprint .. ' ' .. submission, 'EX', ttl)
end
"""

# Lua prelude: count one more caller waiting on a queued request (``Keys.waiters``; absent =
# only the submitter, so the first to join makes it 2), kept for at least ``ttl`` s. Read by
# ``FINISH_LUA`` (one answer copy per waiter) and ``LEAVE_LUA`` (the last one out cancels).
WAITERS_LUA = """local function join(waiters, ttl)
  if redis.call('INCR', waiters) == 1 then
    redis.call('INCR', waiters)
    redis.call('EXPIRE', waiters, ttl)
  else
    redis.call('EXPIRE', waiters, ttl, 'GT')
  end
end
"""

# Lua prelude: delete a request's binding and mark the submission it names cancelled for
# ``ttl`` s; 0 when there was no binding.
FORGET_BINDING_LUA = """local function forget_binding(binding, mark, ttl)
  local bound = redis.call('GET', binding)
  if not bound then return 0 end
  redis.call('DEL', binding)
  local submission = string.match(bound, ' (.*)$')
  if submission then redis.call('SET', mark, submission, 'EX', ttl) end
  return 1
end
"""

# Atomic: "not answered yet" and "queued", so a retry can never be queued after its answer.
# KEYS: stream, result. ARGV: request id, payload, prior deliveries, weight. 0: answered.
SUBMIT_LUA = f"""if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
{xadd_lua("KEYS[1]", "ARGV[1]", "ARGV[2]", "ARGV[3]", "ARGV[4]")}
return 1"""

# Atomic: bind a request id to its content (KEYS[3] holds the fingerprint, ARGV[4]) and queue
# it, so the same id is queued once however many callers send it at once. -1 when the id is
# bound to other content, 0 when answered, 2 when queued already (its first execution is
# alive), 1 when bound and queued now. ``sub`` (ARGV[7]) tags this submission.
SUBMIT_BOUND_LUA = (
    BINDING_LUA
    + f"""local bound = redis.call('GET', KEYS[3])
if bound_elsewhere(bound, ARGV[4]) then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if bound then return 2 end
bind(KEYS[3], ARGV[4], ARGV[7], ARGV[5])
{xadd_lua("KEYS[1]", "ARGV[1]", "ARGV[2]", "'0'", "ARGV[6]", "ARGV[7]")}
return 1"""
)

# Atomic: "still unanswered" and "forget the binding (KEYS[1]), mark the submission cancelled
# (KEYS[2], for ARGV[1] s)"; nothing once it is answered (KEYS[3]): the binding must outlive it.
UNBIND_LUA = (
    FORGET_BINDING_LUA
    + """if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
return forget_binding(KEYS[1], KEYS[2], ARGV[1])"""
)

# Atomic: one entry's move (KEYS[1] -> KEYS[2]): it is in exactly one stream at any instant,
# so a mover dying anywhere loses nothing and a second mover cannot copy it twice. An entry
# gone already (answered, or moved by another) is left alone (0); an answered one still
# queued is dropped (2). ARGV: group, entry id, deliveries so far (the copy's ``prior``).
MOVE_LUA = Template("""local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #found == 0 then return 0 end
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then return 2 end
local fields, out = found[1][2], {}
for i = 1, #fields, 2 do
  if fields[i] ~= '$prior' then out[#out + 1] = fields[i]; out[#out + 1] = fields[i + 1] end
end
out[#out + 1] = '$prior'; out[#out + 1] = ARGV[3]
redis.call('XADD', KEYS[2], '*', unpack(out))
return 1""").substitute(prior=PRIOR)

# Atomic: a job's answer: check the fence, store the answer unless one exists (first wins),
# store member answers, wake waiters, ack and delete the entry, file it as dead if asked; so
# no answer is stored without its entry leaving, nor by a consumer whose lease lapsed.
# KEYS: stream, fence key, dead stream, result, notify, waiters, then member result keys.
# ARGV: group, entry id, fence token ('' = none), ttl, notify ttl, '1' to require the entry
# still queued, k, k dead-letter fields (k = 0: none), the answer, member answers. -1: fenced
# (the lease is not ours), -2: entry gone (moved away), else 1 if ours was the first answer,
# 0 if one existed already. The wake-up carries the stored answer, one copy per counted waiter
# (``Keys.waiters``; at least one), so a waiter needs no GET after it.
FINISH_LUA = """local got = redis.call('MGET', KEYS[2], KEYS[6])
if ARGV[3] ~= '' and got[1] ~= ARGV[3] then return -1 end
if redis.call('XDEL', KEYS[1], ARGV[2]) == 0 and ARGV[6] == '1' then return -2 end
local k = tonumber(ARGV[7])
local answer, first = ARGV[8 + k], 1
if not redis.call('SET', KEYS[4], answer, 'NX', 'EX', ARGV[4]) then
  first, answer = 0, redis.call('GET', KEYS[4])
end
for i = 7, #KEYS do redis.call('SET', KEYS[i], ARGV[2 + k + i], 'NX', 'EX', ARGV[4]) end
local copies = {}
for i = 1, math.min(1000, math.max(1, tonumber(got[2]) or 1)) do copies[i] = answer end
redis.call('RPUSH', KEYS[5], unpack(copies))
redis.call('EXPIRE', KEYS[5], ARGV[5])
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
if k > 0 then redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', unpack(ARGV, 8, 7 + k)) end
return first"""

# Atomic: read the server's data epoch (``Keys.epoch``), writing ARGV[1] if there is none, so
# every reader of one data set sees one token and a server that lost its data gets a new one.
EPOCH_LUA = """redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])"""

# Atomic: an answer the fence refused (``FINISH_LUA`` -1 or -2) is stored all the same when
# the server lost its data since the job was read (the epoch, KEYS[1], is not ARGV[1]): the
# lease and the entry vanished with the data, not because the work moved, so the answer is
# the only one there is. Stored as ``FINISH_LUA`` stores it (first answer wins, members too,
# one wake-up copy per counted waiter); no stream is touched (the entry is gone, and a caller's
# resubmitted copy is answered DUPLICATE when it is read). -1: no reset, the answer is
# discarded; else 1 if ours was the first answer, 0 if one existed already.
# KEYS: epoch, result, notify, waiters, member result keys. ARGV: job epoch, ttl, notify ttl,
# the answer, member answers.
SALVAGE_LUA = """local got = redis.call('MGET', KEYS[1], KEYS[4])
if got[1] == ARGV[1] then return -1 end
local answer, first = ARGV[4], 1
if not redis.call('SET', KEYS[2], answer, 'NX', 'EX', ARGV[2]) then
  first, answer = 0, redis.call('GET', KEYS[2])
end
for i = 5, #KEYS do redis.call('SET', KEYS[i], ARGV[i], 'NX', 'EX', ARGV[2]) end
local copies = {}
for i = 1, math.min(1000, math.max(1, tonumber(got[2]) or 1)) do copies[i] = answer end
redis.call('RPUSH', KEYS[3], unpack(copies))
redis.call('EXPIRE', KEYS[3], ARGV[3])
return first"""

# Atomic: a counted waiter (``Keys.waiters``; absent = only the submitter) leaves, and the last
# one out of an unanswered request forgets its binding and marks its submission cancelled (as
# ``UNBIND_LUA``), so two callers leaving at once cannot both think the other stays.
# KEYS: waiters, binding, cancel mark, result; ARGV: mark ttl.
LEAVE_LUA = (
    FORGET_BINDING_LUA
    + """local left = 0
if redis.call('EXISTS', KEYS[1]) == 1 then left = redis.call('DECR', KEYS[1]) end
if left > 0 or redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
return forget_binding(KEYS[2], KEYS[3], ARGV[1])"""
)

# Atomic: count the requests waiting in a stream (an entry's ``n``, 1 when absent) and store
# the count as KEYS[2][ARGV[1]], so no entry added or answered meanwhile is half counted.
RECOUNT_LUA = Template("""local total, start = 0, '-'
while true do
  local batch = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  if #batch == 0 then break end
  for _, entry in ipairs(batch) do
    local n, fields = 1, entry[2]
    for i = 1, #fields, 2 do if fields[i] == '$weight' then n = tonumber(fields[i + 1]) or 1 end end
    total = total + n
  end
  start = '(' .. batch[#batch][1]
end
if total > 0 then redis.call('HSET', KEYS[2], ARGV[1], total)
else redis.call('HDEL', KEYS[2], ARGV[1]) end
return total""").substitute(weight=WEIGHT)


class Scripts:
    """The scripts registered on one client (registering only hashes the text; Redis loads a
    script on its first use)."""

    def __init__(self, redis: Redis) -> None:
        self.submit = redis.register_script(SUBMIT_LUA)
        self.submit_bound = redis.register_script(SUBMIT_BOUND_LUA)
        self.unbind = redis.register_script(UNBIND_LUA)
        self.move = redis.register_script(MOVE_LUA)
        self.finish = redis.register_script(FINISH_LUA)
        self.leave = redis.register_script(LEAVE_LUA)
        self.recount = redis.register_script(RECOUNT_LUA)
        self.epoch = redis.register_script(EPOCH_LUA)
        self.salvage = redis.register_script(SALVAGE_LUA)
