-- settle.lua: ends a hold made by hold.lua, for quotad: settles it at the actual cost, or
-- releases it (nothing used).
--
-- KEYS[1]  the hold's record (hash)   qd:v1:{tenant}:~h:<id>, as hold.lua writes it
-- KEYS[2]  activity index (set of state keys decided since the last usage collection)
-- ARGV[1]  'settle' or 'release'
-- ARGV[2]  settle: the actual cost in whole tokens, integer 0..9007199254; release: ''
-- ARGV[3]  optional explicit now in ms since the epoch ('': Redis TIME)
-- ARGV[4]  optional minimum idle TTL in ms, integer 1..2^53-1 ('': 60000)
-- returns  {0}: no such hold (never made, or forgotten HOLD_MEMORY_MS after it ended)
--          {1, replayed 0|1, then 6 per limit: state key, charged, clamped, refunded,
--           remaining, debt (whole tokens)}: ended now, or (replayed) by the same call before
--          {2, expired_at_ms}: open past its expiry; nothing changed (the estimate stays spent)
--          {3, why}: ended otherwise before (settled at another cost; a settled hold released;
--           a released hold settled); nothing changed
-- errors   'ERR quotad: <what>' for every invalid argument, a record key not of that form or
--          of another type, a record out of bounds (its limits' keys not of its tenant among
--          them), a key of another type, a stored parameter or state out of bounds; nothing
--          is written then (every check comes before the first write).
--
-- The buckets are those the record names (its caller knows only the hold): their keys carry
-- the record's hash tag {tenant}, which is checked, so they share KEYS[1]'s slot and a Redis
-- Cluster node runs the script as it runs one that declares them. Each is read as hold.lua
-- reads it (its state, else its stored parameters, else the fallback the record keeps; the
-- floor's from the lease end on). For an open hold before its expiry, on each bucket:
--
--   actual > estimate  the excess is charged as charge.lua charges it: into debt down to the
--                      recorded debt limit (cut to 2^53 - 1 less the capacity in force, which
--                      may have grown since), the rest clamped; charged tokens count as
--                      admitted, clamped ones as denied; written with charge.lua's TTL
--   actual < estimate  the difference is refunded as refund.lua refunds it: the debt repaid
--                      first, never above the capacity, nothing for a bucket without state
--                      (full); it comes off the admitted count (not below 0); TTL kept
--   equal              nothing
--
-- A concurrency hold (the record's k 'slots'): its slot is freed (ZREM), whatever the actual
-- cost; its result is {0, 0, 1 (the slot given back), the slots free after under the limit in
-- force, 0}.
--
-- A release is a settle at 0. The record then keeps s 's' (settled; a the actual cost) or 'r'
-- (released), r the results (MessagePack, {charged, clamped, refunded, remaining, debt} per
-- limit) and f = now + HOLD_MEMORY_MS, with the key's PX. The same call again (a settle at the
-- same cost, a release) answers r, replayed, and writes nothing, so the store's own retry of a
-- call and a Cluster client's apply once. The quota-core hold module is the reference.

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

if #KEYS ~= 2 or KEYS[1] == KEYS[2] then
  return err('expected 2 distinct keys: the record and the activity index')
end
local tag, id = string.match(KEYS[1], '^qd:v1:({[^}]+}):~h:([A-Za-z0-9_%-]+)$')
if not tag or #id > MAX_HOLD_ID then
  return err('the record key must be qd:v1:{tenant}:~h:<id of 1..' .. MAX_HOLD_ID
    .. ' of A-Z a-z 0-9 _ ->')
end
local own = 'qd:v1:' .. tag .. ':'
if #ARGV ~= 4 then
  return err('expected 4 arguments')
end
local release = ARGV[1] == 'release'
if not release and ARGV[1] ~= 'settle' then
  return err('the first argument must be settle or release')
end
local actual = 0
if release then
  if ARGV[2] ~= '' then
    return err('a release takes no cost')
  end
else
  actual = int(ARGV[2], MAX_COST)
  if actual == nil then
    return err('the actual cost must be an integer in 0..' .. MAX_COST)
  end
end
local now = arg_now(ARGV[3])
if now == nil or now + HOLD_MEMORY_MS > MAX_CAP then
  return err('now must be an integer number of ms')
end
local min_ttl = opt_int(ARGV[4], DEFAULT_MIN_TTL_MS, MAX_CAP)
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end

local rec = redis.pcall('HGETALL', KEYS[1])
if failed(rec) then
  return err('the record key holds another type')
end
if #rec == 0 then
  return { 0 }
end
local r = {}
for i = 1, #rec, 2 do
  r[rec[i]] = rec[i + 1]
end
local cost, e, f = int(r.c, MAX_COST), int(r.e, MAX_CAP), int(r.f, MAX_CAP)
if not (cost and cost >= 1 and e and f and int(r.t, MAX_HOLD_TTL)
    and (r.s == 'o' or r.s == 's' or r.s == 'r') and type(r.l) == 'string') then
  return err('the hold record is invalid')
end
if now >= f then
  return { 0 } -- forgotten: the key outlives f only on a clock other than now's
end
if r.s == 'o' and now >= e then
  return { 2, e }
end
-- The limits: {state key, parameters key, fallback capacity, refill, period, debt limit}; of
-- a concurrency hold (k 'slots') one {slots key, parameters key, usage key, fallback limit,
-- debt limit}.
local slots = r.k == 'slots'
if r.k ~= nil and not slots then
  return err('the hold record is invalid')
end
local ok, limits = pcall(cmsgpack.unpack, r.l)
if not ok or type(limits) ~= 'table' or #limits < 1 or #limits > MAX_LIMITS
    or (slots and #limits ~= 1) then
  return err('the hold record is invalid')
end
local n = #limits
local function whole(x, max)
  return type(x) == 'number' and x % 1 == 0 and x >= 0 and x <= max
end
for i = 1, n do
  local l = limits[i]
  if type(l) ~= 'table' or type(l[1]) ~= 'string' or type(l[2]) ~= 'string'
      or string.sub(l[1], 1, #own) ~= own or string.sub(l[2], 1, #own) ~= own
      or l[1] == l[2] then
    return err('the hold record is invalid')
  end
  if slots then
    if #l ~= 5 or type(l[3]) ~= 'string' or string.sub(l[3], 1, #own) ~= own or l[3] == l[1]
        or l[3] == l[2] or not whole(l[4], MAX_SLOTS) or not whole(l[5], MAX_CAP) then
      return err('the hold record is invalid')
    end
  elseif #l ~= 6 or not whole(l[3], MAX_CAP) or not whole(l[4], MAX_CAP)
      or not whole(l[5], MAX_PERIOD) or not bucket_ok(l[3], l[4], l[5])
      or not whole(l[6], MAX_CAP) then
    return err('the hold record is invalid')
  end
end

-- Ends the record with the results res, remembered for HOLD_MEMORY_MS: released, or settled
-- at the actual cost (a repeated call is answered from it).
local function record_end(res)
  if release then
    redis.call('HSET', KEYS[1], 's', 'r', 'r', cmsgpack.pack(res), 'f',
      string.format('%d', now + HOLD_MEMORY_MS))
  else
    redis.call('HSET', KEYS[1], 's', 's', 'a', string.format('%d', actual), 'r',
      cmsgpack.pack(res), 'f', string.format('%d', now + HOLD_MEMORY_MS))
  end
  redis.call('PEXPIRE', KEYS[1], HOLD_MEMORY_MS)
end

if r.s ~= 'o' then
  -- Ended before: the same call is answered again, any other is a conflict.
  local a = r.s == 's' and int(r.a, MAX_COST)
  if r.s == 's' and not a then
    return err('the hold record is invalid')
  end
  if r.s == 's' and release then
    return { 3, string.format('settled at %d tokens: a settled hold is not released', a) }
  elseif r.s == 's' and a ~= actual then
    return { 3, string.format('settled at %d tokens, not %d', a, actual) }
  elseif r.s == 'r' and not release then
    return { 3, 'released: a released hold is not settled' }
  end
  local okr, res = pcall(cmsgpack.unpack, r.r or '')
  if not okr or type(res) ~= 'table' or #res ~= n then
    return err('the hold record is invalid')
  end
  local out = { 1, 1 }
  for i = 1, n do
    local x = res[i]
    if type(x) ~= 'table' or #x ~= 5 then
      return err('the hold record is invalid')
    end
    out[#out + 1] = limits[i][1]
    for j = 1, 5 do
      if type(x[j]) ~= 'number' or x[j] % 1 ~= 0 or x[j] < 0 or x[j] > MAX_CAP then
        return err('the hold record is invalid')
      end
      out[#out + 1] = x[j]
    end
  end
  return out
end

-- A concurrency hold: its slot freed (whatever the actual cost), and the slots free after
-- under the limit in force (as hold.lua reads it).
if slots then
  local sk, pk = limits[1][1], limits[1][2]
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
  redis.call('ZREM', sk, id)
  local live = redis.call('ZCOUNT', sk, '(' .. string.format('%d', now), '+inf')
  local res = { { 0, 0, 1, math.max(limit - live, 0), 0 } }
  record_end(res)
  return { 1, 0, sk, 0, 0, 1, res[1][4], 0 }
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

local buckets = {}
for i = 1, n do
  local b, x = bucket_at(i, limits[i])
  if not b then
    return x
  end
  buckets[i] = b
end

-- Each bucket: the excess charged, or the difference refunded.
local res, out, listed = {}, { 1, 0 }, {}
for i = 1, n do
  local b = buckets[i]
  local charged, clamped, refunded = 0, 0, 0
  if actual > cost then
    local excess = actual - cost
    local limit = limits[i][6]
    if limit > MAX_CAP - b.ecap then
      limit = MAX_CAP - b.ecap
    end
    local room = b.t + limit
    if room > 0 then
      charged = (room - fmod(room, UT)) / UT
      if charged > excess then
        charged = excess
      end
    end
    b.t = b.t - charged * UT
    clamped = excess - charged
    b.write = 'charge'
    if b.ad + b.dn == 0 then
      listed[#listed + 1] = limits[i][1]
    end
  elseif actual < cost then
    refunded = cost - actual
    if b.v then
      local back = refunded * UT
      if back >= b.ecap - b.t then
        b.t, b.c = b.ecap, 0
      else
        b.t = b.t + back
      end
      b.write = 'refund'
    end
  end
  local left, owed = 0, 0
  if b.t > 0 then
    left = (b.t - fmod(b.t, UT)) / UT
  elseif b.t < 0 then
    local rem = fmod(-b.t, UT)
    owed = (-b.t - rem) / UT
    if rem > 0 then
      owed = owed + 1
    end
  end
  res[i] = { charged, clamped, refunded, left, owed }
  out[#out + 1] = limits[i][1]
  out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4], out[#out + 5] =
    charged, clamped, refunded, left, owed
end

-- Writes, last: the index (the only write that can fail), the states, the record.
if #listed > 0 then
  local x = redis.pcall('SADD', KEYS[2], unpack(listed))
  if type(x) ~= 'number' then
    return err('the activity index holds another type')
  end
end
for i = 1, n do
  local b = buckets[i]
  local sk = limits[i][1]
  if b.write == 'charge' then
    -- Usage counters saturate at MAX_CAP, so a state stays valid.
    b.ad = math.min(b.ad + res[i][1], MAX_CAP)
    b.dn = math.min(b.dn + res[i][2], MAX_CAP)
    local v = struct.pack(STATE_FMT, b.t, b.c, b.ts, b.ad, b.dn, b.cap, b.rate, b.src, b.le,
      b.fcap, b.frate, b.per)
    local reset = 0
    if b.t < b.ecap then
      if b.erate == 0 then
        reset = -1
      else
        reset = time_to(b.ecap - b.t, b.c, b.erate, b.per)
      end
    end
    if reset == -1 then
      redis.call('SET', sk, v)
    elseif reset < min_ttl then
      redis.call('SET', sk, v, 'PX', min_ttl)
    else
      redis.call('SET', sk, v, 'PX', reset)
    end
  elseif b.write == 'refund' then
    b.ad = b.ad - res[i][3]
    if b.ad < 0 then
      b.ad = 0
    end
    redis.call('SET', sk, struct.pack(STATE_FMT, b.t, b.c, b.ts, b.ad, b.dn, b.cap, b.rate,
      b.src, b.le, b.fcap, b.frate, b.per), 'KEEPTTL')
  end
end
record_end(res)
return out
