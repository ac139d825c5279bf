-- hold.lua: makes a hold for quotad: an estimated cost spent now on 1 to 16 token buckets of
-- one tenant, all or nothing, or one slot of a concurrency limit, and a record of it, settled
-- or released later (settle.lua).
--
-- KEYS[1]     the hold's record (hash)   qd:v1:{tenant}:~h:<id>, id 1..64 of [A-Za-z0-9_-]
-- KEYS[2]     activity index (set of state keys decided since the last usage collection)
-- KEYS[2i+1]  limit i's bucket state (string), as KEYS[1] of token_bucket.lua
-- KEYS[2i+2]  limit i's bucket parameters (hash), as KEYS[2] of token_bucket.lua
--             for n limits, 1 <= n <= 16; every key distinct, and every bucket key of the
--             record's tenant (qd:v1:{tenant}:…), so all share one hash slot
-- ARGV[1]     the estimate in whole tokens, integer 1..9007199254
-- ARGV[2]     ttl in ms, integer 1..3600000: the hold expires unsettled at now + ttl
-- ARGV[3]     optional explicit now in ms since the epoch ('': Redis TIME)
-- ARGV[4]     optional minimum idle TTL in ms, integer 1..2^53-1 ('': 60000)
-- ARGV[4i+1]  limit i's fallback capacity in micro-tokens, used when no parameters are stored
-- ARGV[4i+2]  limit i's fallback refill in micro-tokens per period
-- ARGV[4i+3]  limit i's fallback refill period in ms, integer 1..2678400000 ('': 1000)
-- ARGV[4i+4]  limit i's debt limit in micro-tokens: how far below empty a settle above the
--             estimate may take the bucket (as charge.lua's), integer 0..2^53-1, with the
--             capacity in force plus the limit at most 2^53-1
-- returns     {held 0|1, expires_at_ms, replayed 0|1, then 4 integers per limit: allowed 0|1,
--             remaining whole tokens (0 in debt), retry_after_ms (-1 = never at these
--             parameters), reset_ms (-1 = never)}: expires_at_ms is now + ttl (the recorded
--             one when replayed); when the hold is denied, a limit that would have admitted
--             answers allowed 1 with its level unspent, as token_buckets.lua
--
-- A concurrency hold (ARGV[5] 'slots'): one slot of one concurrency limit, estimate 1.
-- KEYS[3..5]  the limit's slots (sorted set of hold ids scored by expiry)
--             qd:v1:{tenant}:<policy>:<version>:c, its parameters (…:p: slots, and with a
--             lease end until and the floor fslots) and its usage (hash ad, dn, …:cu)
-- ARGV[6..8]  the fallback limit in slots (0..1000000), '', and a debt limit (only recorded)
-- returns     as above for one limit: remaining is the slots free after, retry_after_ms (when
--             denied) the ms until enough live slots expire on their own for one more (-1 for a
--             limit of 0), reset_ms the ms until every live slot has expired
--
-- errors      'ERR quotad: <what>' (naming the limit i where one is at fault) for every invalid
--             argument (the fallbacks are checked even when unused: the record keeps them), a
--             record key not of that form, repeated keys, keys of another type, a stored
--             parameter, state or record out of bounds, a debt limit too large for the capacity
--             in force, and an id whose live record is of another request ('this hold id names
--             a hold of another request'); nothing is written then (every check comes before
--             the first write).
--
-- The decision is token_buckets.lua's (quota-core bucket::decide_all; each bucket read as
-- token_bucket.lua reads it: its state, else its stored parameters, else the fallback; the
-- floor's from the lease end on): admitted when every bucket holds the estimate, which is then
-- spent on each and counted as admitted; denied otherwise, the buckets that denied written as
-- a denial (refilled, the estimate counted as denied) and the others untouched. Only an
-- admitted hold writes its record:
--
--   s 'o' (open; settle.lua writes 's' settled or 'r' released), c the estimate, t the ttl,
--   e expires_at = now + ttl, f forget at = e + HOLD_MEMORY_MS (the key's PX ends there too),
--   l the limits: MessagePack of {state key, parameters key, fallback capacity, refill,
--   period, debt limit} per limit, all settle.lua needs (its caller names only the record)
--
-- A concurrency hold drops the slots expired by now (score <= now, ZREMRANGEBYSCORE), then
-- takes one (ZADD, score now + ttl) while fewer than the limit in force are live: the stored
-- one, the floor from the lease end on (the holders keep their slots; new ones wait until
-- fewer than the floor are live), else the fallback. The set expires with its last slot. An
-- acquisition admitted or denied counts 1 in the usage hash (ad or dn, as a window's), listed
-- in the activity index while ad + dn > 0; collect_usage.lua reports it. A settle or release
-- frees the slot at once (ZREM); a crashed holder's slot comes back at its expiry. The
-- reference is quota-core's slots module; the record is as above, with k 'slots' and l
-- {{slots key, parameters key, usage key, fallback limit, debt limit}}.
--
-- A create whose id has a live record (now < f) decides nothing: the same request (estimate,
-- ttl and limits equal) is answered again, held, replayed, with each bucket's level as it
-- stands (a peek), and writes nothing, so a retried create (the daemon's own, a Cluster
-- client's, or the caller's under its idempotency id) spends once; another request is
-- refused. A denied create leaves no record, so its retry decides afresh (a denial counted
-- twice, as for a retried check). The quota-core hold module is the reference of all this.

-- quotad shared helpers: begin. The same text in every script in lua/ (each script runs on its
-- own, so the block is copied, not included); a test holds the copies equal, the bounds equal to
-- quota-core's bounds.rs, and every call of quotad_helpers to the same arguments.
local UT = 1000000 -- micro-tokens per token
local MAX_CAP = 9007199254740991 -- 2^53 - 1: capacities and refills in µt, times and TTLs in ms
local MAX_PERIOD = 2678400000 -- longest refill period in ms (31 days, below 2^32)
local DEFAULT_PERIOD_MS = 1000 -- period of a refill given per second, and of old states
local MAX_FILL = 9000000000000 -- floor(capacity / refill) * period stays below this
local MAX_WAIT = 2251799813685248 -- 2^51: longest wait reported in ms; longer reads as never
local MAX_COST = 9007199254 -- MAX_CAP / UT: whole tokens per call
local MAX_LIMITS = 16 -- most token buckets one check of several limits decides
local MAX_WINDOW_LIMIT = 1000000000 -- sliding-window limit in tokens
local MAX_WINDOW_MS = 2678400000 -- longest window: 31 days
local MAX_WINDOW_PRODUCT = 2251799813685248 -- 2^51: largest limit * window
local EXACT_LOG_MAX = 128 -- largest sliding-window limit kept as an exact log
local DEFAULT_MIN_TTL_MS = 60000 -- minimum idle TTL when none is given
local DEFAULT_MIN_TTL_ARG = '60000' -- the same as a command argument
local DEFAULT_PERIOD_ARG = '1000' -- DEFAULT_PERIOD_MS as a command argument
local COLLECT_MAX = 100000 -- most keys one usage collection takes
local ONCE_MS = 10000 -- how long a key making a call exactly once lives: past any retry of it
local MAX_HOLD_TTL = 3600000 -- longest a hold lives unsettled, in ms (1 h)
local HOLD_MEMORY_MS = 600000 -- how long a hold's record is kept after the hold ended
local MAX_HOLD_ID = 64 -- longest hold id, in characters
local MAX_SLOTS = 1000000 -- largest concurrency limit, in slots
local STATE_LEN = 96 -- bytes of a token-bucket state
local STATE_LEN_NO_PERIOD = 88 -- bytes of a state written without its period (period 1000)
-- Token-bucket state: 12 little-endian doubles (exact for integers below 2^53): tokens (µt;
-- negative in debt, down to -MAX_CAP), carry (1/per µt), ts (latest ms seen), ad / dn (tokens
-- admitted / denied since the last collection, bytes 25..40), cap, rate, src, until, fcap,
-- frate, per (see token_bucket.lua).
-- A state of the first 11 alone (88 bytes) has per = 1000: rate and frate are µt per second.
local STATE_FMT = '<dddddddddddd'
local STATE_FMT_NO_PERIOD = '<ddddddddddd'
-- Usage counters ad = dn = 0 as they sit in a state (bytes 25..40): two doubles 0.0.
local ZERO_USAGE = '\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0'
local ERR = 'ERR quotad: ' -- prefix of every error reply
-- A decimal integer argument: 1 to 16 digits, no sign, point, exponent, hex or space.
local DIGITS = '^%d+$'
local find = string.find

-- The helpers. Lua creates a closure for every function a script defines, on every call, and
-- one upvalue object for every local a closure captures, so they are made by one call, where a
-- script needs them: quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
-- MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
-- STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT) returns them in a table. The factory captures
-- nothing (the bounds come as arguments), so defining it costs one closure; token_bucket.lua
-- decides its common paths without it. Exactness: every value is an integer below 2^53, so
-- x % y (x >= 0, y >= 1) is exact there, as math.fmod is everywhere.
local function quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
    MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
    STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
  local fmod, ceil, find = math.fmod, math.ceil, string.find

  local function err(what)
    return redis.error_reply('ERR quotad: ' .. what)
  end

  -- A decimal integer string (1 to 16 digits: no sign, point, exponent, hex or space) at most
  -- max, as a number; nil for anything else.
  local function int(s, max)
    if type(s) ~= 'string' or #s == 0 or #s > 16 or find(s, '%D') then
      return nil
    end
    local n = tonumber(s)
    if n > max then
      return nil
    end
    return n
  end

  -- An optional explicit now in ms ('' or absent: Redis TIME, in whole ms); nil when invalid.
  local function arg_now(s)
    if s == nil or s == '' then
      local t = redis.call('TIME')
      local us = tonumber(t[2])
      return tonumber(t[1]) * 1000 + (us - fmod(us, 1000)) / 1000
    end
    return int(s, MAX_CAP)
  end

  -- An optional integer argument in 1..max ('' or absent: default); nil when invalid.
  local function opt_int(s, default, max)
    if s == nil or s == '' then
      return default
    end
    local n = int(s, max)
    if n == nil or n < 1 then
      return nil
    end
    return n
  end

  -- A reply that is a Redis error (redis.pcall), e.g. WRONGTYPE: the key holds another type.
  local function failed(r)
    return type(r) == 'table' and r.err ~= nil
  end

  -- Token-bucket parameters within the bounds of quota-core BucketParams::per_period: cap µt,
  -- refilling rate µt every per ms. floor(cap / rate) * per is compared with MAX_FILL, below
  -- 2^53, so even a product rounded above 2^53 compares correctly. x % 1 == 0 is false for NaN
  -- and infinities.
  local function bucket_ok(cap, rate, per)
    if cap == nil or rate == nil or per == nil or cap % 1 ~= 0 or rate % 1 ~= 0
        or per % 1 ~= 0 or cap < 0 or cap > MAX_CAP or rate < 0 or rate > MAX_CAP or per < 1
        or per > MAX_PERIOD then
      return false
    end
    return rate == 0 or (cap - fmod(cap, rate)) / rate * per < MAX_FILL
  end

  -- Sliding-window parameters within the bounds of quota-core WindowParams::new (integers).
  local function window_ok(limit, w)
    return limit ~= nil and w ~= nil and limit <= MAX_WINDOW_LIMIT and w >= 1
      and w <= MAX_WINDOW_MS and limit * w <= MAX_WINDOW_PRODUCT
  end

  -- The fields of a token-bucket state, or nil when v is not one (wrong length, NaN, a
  -- fraction or a value out of bounds; without a lease, until = -1 and the floor 0, 0):
  -- tokens (negative in debt), carry, ts, ad, dn, cap, rate, src, until, fcap, frate, per.
  local function state_decode(v)
    local t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per
    if #v == STATE_LEN then
      t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per =
        struct.unpack(STATE_FMT, v)
    elseif #v == STATE_LEN_NO_PERIOD then
      t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate =
        struct.unpack(STATE_FMT_NO_PERIOD, v)
      per = DEFAULT_PERIOD_MS
    else
      return nil
    end
    if t % 1 == 0 and t >= -MAX_CAP and t <= MAX_CAP and ts % 1 == 0 and ts >= 0 and ts <= MAX_CAP
        and ad % 1 == 0 and ad >= 0 and ad <= MAX_CAP and dn % 1 == 0 and dn >= 0
        and dn <= MAX_CAP and bucket_ok(cap, rate, per) and c % 1 == 0 and c >= 0 and c < per
        and (src == 0 or src == 1)
        and ((lease_end == -1 and fcap == 0 and frate == 0) or (lease_end % 1 == 0
          and lease_end >= 0 and lease_end <= MAX_CAP and bucket_ok(fcap, frate, per))) then
      return t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per
    end
    return nil
  end

  -- floor((a * b + c) / p) and its remainder for integers a, b, c < p <= MAX_PERIOD (< 2^32),
  -- exact: when a * b + c could pass 2^53, b is split at 2^16 so no product does.
  local function muldiv(a, b, c, p)
    local n = a * b + c
    if n <= MAX_CAP then
      local r = fmod(n, p)
      return (n - r) / p, r
    end
    local bl = fmod(b, 65536)
    local x = a * ((b - bl) / 65536)
    local xr = fmod(x, p)
    local y = xr * 65536 + a * bl + c
    local yr = fmod(y, p)
    return (x - xr) / p * 65536 + (y - yr) / p, yr
  end

  -- Whether e ms from carry c add at least need µt (need > 0) at rate µt per per ms, i.e.
  -- need <= floor((e * rate + c) / per), exact for any e: with e = q * per + e0 and
  -- rate = a * per + b, e * rate + c = (q * rate + e0 * a) * per + (e0 * b + c), and the terms
  -- are taken off need one by one, so a product above 2^53 (inexact) only ever stands for
  -- "more than enough".
  local function enough(e, need, c, rate, per)
    local e0, b = fmod(e, per), fmod(rate, per)
    need = need - (e - e0) / per * rate
    if need <= 0 then
      return true
    end
    need = need - e0 * ((rate - b) / per)
    if need <= 0 then
      return true
    end
    return need <= muldiv(e0, b, c, per)
  end

  -- ceil((need * per - carry) / rate), the ms until need more µt accrue (0 < need <= MAX_CAP,
  -- rate > 0), or -1 when that is beyond MAX_WAIT (only a deep debt at a slow refill comes
  -- near): directly when need * per is exact, else estimated in doubles (three roundings, off
  -- by less than 1 up to MAX_WAIT + 3, so an estimate above MAX_WAIT + 2 is beyond it) and
  -- made exact with enough.
  local function time_to(need, carry, rate, per)
    local n = need * per
    local t
    if n <= MAX_CAP then
      n = n - carry
      local r = fmod(n, rate)
      t = (n - r) / rate
      if r > 0 then
        t = t + 1
      end
    else
      t = ceil((n - carry) / rate)
      if t > MAX_WAIT + 2 then
        return -1
      end
      if not enough(t, need, carry, rate, per) then
        t = t + 1
      elseif t > 1 and enough(t - 1, need, carry, rate, per) then
        t = t - 1
      end
    end
    if t > MAX_WAIT then
      return -1
    end
    return t
  end

  -- A bucket's tokens (its level: negative in debt) and carry clipped to cap, and to
  -- cap - MAX_CAP below (a debt deeper than these parameters keep exact: cap - tokens must stay
  -- below 2^53), and refilled from ts to now at rate per per ms (nothing when now <= ts: a
  -- clock stepping back), and the latest time seen. The µt added are floor((e * rate + c) /
  -- per), the carry its remainder: directly when e * rate + c is exact, else split as in
  -- enough (the sum stays below cap - tokens there, so every term is exact).
  local function refilled(tokens, carry, ts, cap, rate, per, now)
    if tokens >= cap then
      tokens, carry = cap, 0
    elseif tokens < cap - MAX_CAP then
      tokens = cap - MAX_CAP
    end
    if now <= ts then
      return tokens, carry, ts
    end
    if tokens < cap and rate > 0 then
      local e = now - ts
      local n = e * rate + carry
      if n <= MAX_CAP then
        local r = fmod(n, per)
        local add = (n - r) / per
        if add >= cap - tokens then
          return cap, 0, now
        end
        return tokens + add, r, now
      end
      if enough(e, cap - tokens, carry, rate, per) then
        return cap, 0, now
      end
      local e0, b = fmod(e, per), fmod(rate, per)
      local q, r = muldiv(e0, b, carry, per)
      return tokens + (e - e0) / per * rate + e0 * ((rate - b) / per) + q, r, now
    end
    return tokens, carry, now
  end

  return {
    err = err, int = int, arg_now = arg_now, opt_int = opt_int, failed = failed,
    bucket_ok = bucket_ok, window_ok = window_ok, state_decode = state_decode,
    time_to = time_to, refilled = refilled,
  }
end
-- quotad shared helpers: end.

local h = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS, MAX_WINDOW_LIMIT,
  MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD, STATE_FMT,
  STATE_FMT_NO_PERIOD, MAX_WAIT)
local err, int, arg_now, opt_int, failed = h.err, h.int, h.arg_now, h.opt_int, h.failed
local bucket_ok, state_decode, time_to, refilled = h.bucket_ok, h.state_decode, h.time_to,
  h.refilled
local fmod = math.fmod

local n_keys = #KEYS
local slots = ARGV[5] == 'slots' -- a concurrency hold
if slots then
  if n_keys ~= 5 then
    return err('a concurrency hold takes 5 keys: the record, the activity index, the slots, '
      .. 'the parameters and the usage')
  end
elseif n_keys < 4 or n_keys % 2 ~= 0 or n_keys > 2 * MAX_LIMITS + 2 then
  return err('expected the record, the activity index and 2 keys for each of 1..' .. MAX_LIMITS
    .. ' limits')
end
local n = slots and 1 or (n_keys - 2) / 2
local seen = {}
for i = 1, n_keys do
  if seen[KEYS[i]] then
    return err('the ' .. n_keys .. ' keys must be distinct')
  end
  seen[KEYS[i]] = true
end
-- The record names the tenant's hash tag; every bucket key carries it (one slot).
local tag, id = string.match(KEYS[1], '^qd:v1:({[^}]+}):~h:([A-Za-z0-9_%-]+)$')
if not tag or #id > MAX_HOLD_ID then
  return err('the record key must be qd:v1:{tenant}:~h:<id of 1..' .. MAX_HOLD_ID
    .. ' of A-Z a-z 0-9 _ ->')
end
local own = 'qd:v1:' .. tag .. ':'
for i = 3, n_keys do
  if string.sub(KEYS[i], 1, #own) ~= own then
    return err('limit ' .. (slots and 1 or math.floor((i - 1) / 2))
      .. ': its keys are not of the record\'s tenant')
  end
end
if #ARGV ~= 4 + 4 * n then
  return err('expected ' .. (4 + 4 * n) .. ' arguments for ' .. n .. ' limits')
end
local cost = int(ARGV[1], MAX_COST)
if cost == nil or cost < 1 then
  return err('the estimate must be an integer in 1..' .. MAX_COST)
end
if slots and cost ~= 1 then
  return err('a concurrency hold takes one slot: the estimate must be 1')
end
local ttl = int(ARGV[2], MAX_HOLD_TTL)
if ttl == nil or ttl < 1 then
  return err('ttl must be an integer number of ms in 1..' .. MAX_HOLD_TTL)
end
local now = arg_now(ARGV[3])
if now == nil then
  return err('now must be an integer number of ms')
end
if now + ttl + HOLD_MEMORY_MS > MAX_CAP then
  return err('the hold would end too late')
end
local min_ttl = opt_int(ARGV[4], DEFAULT_MIN_TTL_MS, MAX_CAP)
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local limits = {}
for i = 1, slots and 0 or n do
  local a = 4 * i
  local cap, rate = int(ARGV[a + 1], MAX_CAP), int(ARGV[a + 2], MAX_CAP)
  local per = opt_int(ARGV[a + 3], DEFAULT_PERIOD_MS, MAX_PERIOD)
  if not bucket_ok(cap, rate, per) then
    return err('limit ' .. i .. ': fallback capacity, refill and period must be integers '
      .. 'within the bucket bounds')
  end
  local debt = int(ARGV[a + 4], MAX_CAP)
  if debt == nil then
    return err('limit ' .. i .. ': the debt limit must be an integer number of micro-tokens '
      .. 'below 2^53')
  end
  limits[i] = { KEYS[2 * i + 1], KEYS[2 * i + 2], cap, rate, per, debt }
end
if slots then
  local limit = int(ARGV[6], MAX_SLOTS)
  if limit == nil or ARGV[7] ~= '' then
    return err('limit 1: the fallback concurrency limit must be an integer in 0..' .. MAX_SLOTS)
  end
  local debt = int(ARGV[8], MAX_CAP)
  if debt == nil then
    return err('limit 1: the debt limit must be an integer number of micro-tokens below 2^53')
  end
  limits[1] = { KEYS[3], KEYS[4], KEYS[5], limit, debt }
end
local packed = cmsgpack.pack(limits)

-- A live record of this id: the same request is answered again; another is refused.
local rec = redis.pcall('HGETALL', KEYS[1])
if failed(rec) then
  return err('the record key holds another type')
end
local replay -- the recorded expiry when this create is answered again
if #rec > 0 then
  local r = {}
  for i = 1, #rec, 2 do
    r[rec[i]] = rec[i + 1]
  end
  local rc, rt, re, rf = int(r.c, MAX_COST), int(r.t, MAX_HOLD_TTL), int(r.e, MAX_CAP),
    int(r.f, MAX_CAP)
  if not (rc and rt and re and rf and (r.s == 'o' or r.s == 's' or r.s == 'r')
      and type(r.l) == 'string' and (r.k == nil or r.k == 'slots')) then
    return err('the hold record is invalid')
  end
  if now < rf then
    if rc ~= cost or rt ~= ttl or r.l ~= packed then
      return err('this hold id names a hold of another request')
    end
    replay = re
  end
end

-- A concurrency hold: one slot of the sorted set KEYS[3] (hold ids scored by expiry) while
-- fewer than the limit in force are live (score > now): the stored one (slots), the floor
-- (fslots) from the lease end (until) on, else the fallback. Usage in the hash KEYS[5].
if slots then
  local sk, pk, uk = KEYS[3], KEYS[4], KEYS[5]
  local kind = redis.call('TYPE', sk)['ok']
  if kind ~= 'zset' and kind ~= 'none' then
    return err('limit 1: the slots key holds another type')
  end
  local p = redis.pcall('HMGET', pk, 'slots', 'until', 'fslots')
  if failed(p) then
    return err('limit 1: the parameters key holds another type')
  end
  local limit = limits[1][4]
  if p[1] then
    limit = int(p[1], MAX_SLOTS)
    if limit == nil then
      return err('limit 1: stored parameters are invalid')
    end
    if p[2] or p[3] then
      local lease_end, floor = int(p[2], MAX_CAP), int(p[3], MAX_SLOTS)
      if lease_end == nil or floor == nil then
        return err('limit 1: stored parameters are invalid')
      end
      if now >= lease_end then
        limit = floor
      end
    end
  end
  local u = redis.pcall('HMGET', uk, 'ad', 'dn')
  if failed(u) then
    return err('limit 1: the usage key holds another type')
  end
  local ad, dn = int(u[1] or '0', MAX_CAP), int(u[2] or '0', MAX_CAP)
  if ad == nil or dn == nil then
    return err('limit 1: the usage counters are invalid')
  end
  local at = string.format('%d', now)
  -- ms until every live slot has expired (0: none live).
  local function reset_slots()
    local last = redis.call('ZRANGE', sk, -1, -1, 'WITHSCORES')
    local e = last[2] and tonumber(last[2])
    if e and e > now then
      return e - now
    end
    return 0
  end
  if replay then
    local live = redis.call('ZCOUNT', sk, '(' .. at, '+inf')
    return { 1, replay, 1, 1, math.max(limit - live, 0), 0, reset_slots() }
  end

  -- Writes, last: the index (the only write that can fail), the slots, the usage, the record.
  if ad + dn == 0 then
    if failed(redis.pcall('SADD', KEYS[2], uk)) then
      return err('the activity index holds another type')
    end
  end
  redis.call('ZREMRANGEBYSCORE', sk, '-inf', at)
  local live = redis.call('ZCARD', sk)
  local e = now + ttl
  local out = { 0, e, 0, 0, 0, -1, 0 }
  if live < limit then
    redis.call('ZADD', sk, string.format('%d', e), id)
    local pttl = redis.call('PTTL', sk)
    if pttl < ttl then
      redis.call('PEXPIRE', sk, ttl)
    end
    out[1], out[4], out[5], out[6] = 1, 1, limit - live - 1, 0
    ad = math.min(ad + 1, MAX_CAP)
  else
    if limit > 0 then
      -- The (live - limit + 1)-th earliest expiry frees the slot one more needs.
      local k = live - limit
      out[6] = tonumber(redis.call('ZRANGE', sk, k, k, 'WITHSCORES')[2]) - now
    end
    dn = math.min(dn + 1, MAX_CAP)
  end
  out[7] = reset_slots()
  redis.call('HSET', uk, 'ad', string.format('%d', ad), 'dn', string.format('%d', dn))
  redis.call('PEXPIRE', uk, min_ttl)
  if out[1] == 1 then
    redis.call('DEL', KEYS[1])
    redis.call('HSET', KEYS[1], 's', 'o', 'k', 'slots', 'c', '1', 't', string.format('%d', ttl),
      'e', string.format('%d', e), 'f', string.format('%d', e + HOLD_MEMORY_MS), 'l', packed)
    redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl + HOLD_MEMORY_MS))
  end
  return out
end

-- Limit i's bucket as token_bucket.lua reads it, refilled to now: its state, else the stored
-- parameters (a new, full bucket), else the fallback f. A table of its fields (t the level,
-- ecap / erate the parameters in force), or nil and the error reply.
local function bucket_at(i, f)
  local v = redis.pcall('GET', f[1])
  if failed(v) then
    return nil, err('limit ' .. i .. ': the state key holds another type')
  end
  local b = { v = v }
  local cper
  if v then
    b.t, b.c, b.ts, b.ad, b.dn, b.cap, b.rate, b.src, b.le, b.fcap, b.frate, b.per =
      state_decode(v)
    if b.t == nil then
      return nil, err('limit ' .. i .. ': stored state is invalid')
    end
    cper = b.per
  else
    local p = redis.pcall('HGETALL', f[2])
    if failed(p) then
      return nil, err('limit ' .. i .. ': the parameters key holds another type')
    end
    local s = {}
    for j = 1, #p, 2 do
      s[p[j]] = p[j + 1]
    end
    b.le, b.fcap, b.frate, b.src = -1, 0, 0, 0
    if s.cap or s.rate then
      b.cap, b.rate = int(s.cap, MAX_CAP), int(s.rate, MAX_CAP)
      b.per = opt_int(s.per, DEFAULT_PERIOD_MS, MAX_PERIOD)
      if not bucket_ok(b.cap, b.rate, b.per) then
        return nil, err('limit ' .. i .. ': stored parameters are invalid')
      end
      if s['until'] or s.fcap or s.frate then
        b.le, b.fcap, b.frate = int(s['until'], MAX_CAP), int(s.fcap, MAX_CAP),
          int(s.frate, MAX_CAP)
        if b.le == nil or not bucket_ok(b.fcap, b.frate, b.per) then
          return nil, err('limit ' .. i .. ': stored parameters are invalid')
        end
      end
      b.src = 1
    end
    b.c, b.ts, b.ad, b.dn = 0, now, 0, 0
  end
  if b.src == 0 then
    b.cap, b.rate, b.per = f[3], f[4], f[5]
    cper = cper or b.per
  end
  if b.per ~= cper then
    b.c = 0 -- counted in another period's units: less than 1 µt, dropped
  end
  b.ecap, b.erate = b.cap, b.rate
  if b.src == 1 and b.le >= 0 and now >= b.le then
    b.ecap, b.erate = b.fcap, b.frate
  end
  if not v then
    b.t = b.ecap -- a new bucket is full
  end
  b.t, b.c, b.ts = refilled(b.t, b.c, b.ts, b.ecap, b.erate, b.per, now)
  return b
end

-- ms until the bucket is full (-1: never at these parameters, or beyond MAX_WAIT).
local function reset_of(b)
  if b.t >= b.ecap then
    return 0
  end
  if b.erate == 0 then
    return -1
  end
  return time_to(b.ecap - b.t, b.c, b.erate, b.per)
end

-- Whole tokens left (0 in debt).
local function left_of(b)
  if b.t <= 0 then
    return 0
  end
  return (b.t - fmod(b.t, UT)) / UT
end

local buckets = {}
for i = 1, n do
  local b, e = bucket_at(i, limits[i])
  if not b then
    return e
  end
  buckets[i] = b
end
if replay then
  local out = { 1, replay, 1 }
  for i = 1, n do
    local b = buckets[i]
    local k = 4 * i
    out[k], out[k + 1], out[k + 2], out[k + 3] = 1, left_of(b), 0, reset_of(b)
  end
  return out
end

-- Decide each: spend on all when all admit; else deny where it does not, touch nothing else.
local cost_ut = cost * UT
local admitted = true
for i = 1, n do
  local b = buckets[i]
  if b.ecap > MAX_CAP - limits[i][6] then
    return err('limit ' .. i .. ': the capacity in force plus the debt limit must be at most '
      .. '2^53 - 1 micro-tokens')
  end
  if cost_ut > b.t then
    admitted = false
  end
end
local out = { 0, now + ttl, 0 }
if admitted then
  out[1] = 1
end
local listed = {}
for i = 1, n do
  local b = buckets[i]
  local allowed, retry = 1, 0
  b.write = true
  if admitted then
    b.t = b.t - cost_ut
  elseif cost_ut > b.t then
    allowed = 0
    if cost_ut > b.ecap or b.erate == 0 then
      retry = -1
    else
      retry = time_to(cost_ut - b.t, b.c, b.erate, b.per)
    end
  else
    b.write = false -- admits, but another limit denies: untouched
  end
  b.reset = reset_of(b)
  if b.write and b.ad + b.dn == 0 then
    listed[#listed + 1] = limits[i][1]
  end
  local k = 4 * i
  out[k], out[k + 1], out[k + 2], out[k + 3] = allowed, left_of(b), retry, b.reset
end

-- Writes, last: the index (the only write that can fail), the states, the record.
if #listed > 0 then
  local r = redis.pcall('SADD', KEYS[2], unpack(listed))
  if type(r) ~= 'number' then
    return err('the activity index holds another type')
  end
end
for i = 1, n do
  local b = buckets[i]
  if b.write then
    -- Usage counters saturate at MAX_CAP, so a state stays valid.
    if admitted then
      b.ad = math.min(b.ad + cost, MAX_CAP)
    else
      b.dn = math.min(b.dn + cost, MAX_CAP)
    end
    local v = struct.pack(STATE_FMT, b.t, b.c, b.ts, b.ad, b.dn, b.cap, b.rate, b.src, b.le,
      b.fcap, b.frate, b.per)
    if b.reset == -1 then
      redis.call('SET', limits[i][1], v)
    elseif b.reset < min_ttl then
      redis.call('SET', limits[i][1], v, 'PX', min_ttl)
    else
      redis.call('SET', limits[i][1], v, 'PX', b.reset)
    end
  end
end
if admitted then
  local e = now + ttl
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 's', 'o', 'c', string.format('%d', cost), 't',
    string.format('%d', ttl), 'e', string.format('%d', e), 'f',
    string.format('%d', e + HOLD_MEMORY_MS), 'l', packed)
  redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl + HOLD_MEMORY_MS))
end
return out
