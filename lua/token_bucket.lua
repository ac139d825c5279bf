-- token_bucket.lua: one atomic token-bucket decision for quotad.
--
-- KEYS[1]  bucket state (string, expires when idle)  qd:v1:{tenant}:<policy>:<version>:b
-- KEYS[2]  bucket parameters (hash, no TTL)          qd:v1:{tenant}:<policy>:<version>:p
--          fields: cap (capacity, micro-tokens), rate (refill, micro-tokens per period), per
--          (the period in ms; absent: 1000, rate per second), and with a lease end: until (ms,
--          this server's clock), fcap / frate (the floor, same period, in force from until on);
--          written by set_params.lua, read here only when KEYS[1] does not exist
-- KEYS[3]  activity index (set of state keys decided since the last usage collection)
-- ARGV[1]  cost in whole tokens, integer 0..9007199254; 0 is a peek: the bucket's level now,
--          nothing written, nothing counted (returns allowed 1, retry 0)
-- ARGV[2]  fallback capacity in micro-tokens, used when no parameters are stored ('' = none)
-- ARGV[3]  fallback refill in micro-tokens per period ('' = none; given together with ARGV[2])
-- ARGV[4]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- ARGV[5]  optional minimum idle TTL in ms, integer 1..2^53-1 ('' or absent: 60000); keeps the
--          usage counters of an idle bucket until the next collection
-- ARGV[6]  optional fallback refill period in ms, integer 1..2678400000 ('' or absent: 1000,
--          so ARGV[3] is per second)
-- ARGV[7]  optional batch: spend up to this many multiples of the cost at once, as many as the
--          bucket holds, at least one (a daemon's reservation); integer 1..9007199254 with
--          cost * batch <= 9007199254 (absent: 1, and the reply has 4 fields)
-- returns  {allowed 0|1, remaining whole tokens (0 in debt), retry_after_ms (-1 = never at
--           these parameters), reset_ms (ms until full, -1 = never)}, and with ARGV[7] a fifth
--          field: the multiples spent (0 when denied or a peek)
-- errors   'ERR quotad: <what>' for every invalid argument (the fallback ARGV[2], ARGV[3],
--          ARGV[6] only when it is used: no stored parameters and no state copy of them),
--          repeated key, key of another type, stored parameter or state out of bounds; nothing
--          is written then (every check comes before the first write).
--
-- The arithmetic is quota-core/src/bucket.rs exactly (a differential test holds them equal):
-- integer micro-tokens, whole milliseconds, and a rational refill: rate µt every per ms (a
-- policy's share refills share * limit µt per window, so no share's rate is rounded). The part
-- of a micro-token not yet credited is a carry in 1/per µt (< per). Lua numbers are doubles,
-- so every intermediate is kept below 2^53: elapsed * rate is never formed (accrue splits
-- elapsed at per and rate into whole and fraction per ms; the product of two numbers below
-- per < 2^32 splits one of them at 2^16, muldiv), divisions use math.fmod, which is exact, and
-- waits are estimated in doubles, then corrected to the exact ceiling (time_to).
--
-- State: ONE string, struct.pack('<dddddddddddd', t, c, ts, ad, dn, cap, rate, src, until,
-- fcap, frate, per) (96 bytes, little-endian doubles, exact for integers below 2^53): t tokens
-- (µt; negative in debt, see Debt), c carry, ts latest time seen (ms), ad / dn tokens admitted
-- / denied since the last collection, cap / rate / per the parameters, src 1 when they are a copy of the stored
-- parameters (KEYS[2]) or 0 when they came from the fallback (then this call's fallback
-- applies, as the reference does), until the lease end (-1 = none) after which fcap / frate
-- are in force instead. The carry is in 1/per µt of the state's per: parameters of another
-- period drop it (less than 1 µt). An 88-byte state (the same without per) is read with
-- per = 1000, which is what it meant; every write stores 96 bytes. set_params.lua rewrites the
-- copy when the parameters change, so the hot path never reads KEYS[2].
--
-- Lease end: a region's share holds only while its daemon's lease does. The daemon rewrites
-- the parameters when they change and renews until once half of it has passed; if the daemon
-- dies, this script alone drops the bucket to the floor at until, so share the coordinator
-- gives elsewhere is never held twice.
--
-- Debt: charge.lua applies a charge for work already done past the tokens left, down to a
-- level of -debt limit, so t may be negative (at least -MAX_CAP). A check in debt is denied
-- with the wait until t reaches the cost (the repayment included), and the refill repays the
-- debt first. A level below cap - MAX_CAP (parameters changed under a debt) is raised to it,
-- so cap - t stays exact; a wait beyond MAX_WAIT (2^51 ms) is reported as never (-1). Debts
-- are rare, so their waits are taken by the helpers.
--
-- Activity index: the key is listed exactly while ad + dn > 0: every decision adds at least 1
-- and a collection zeroes both, so only the first decision of each report interval pays the
-- SADD.
--
-- Expiry: every decision writes the state with SET ... PX max(time to refill fully, minimum
-- idle TTL): an expired bucket reads as full, so it must not expire before it would be full
-- (from a debt too). With no refill and not full, or a time to full beyond MAX_WAIT, the SET
-- carries no expiry (the key must stay); every other bucket that refills expires.
--
-- Cost: TIME (unless now is given), GET, SET PX per decision (a peek: TIME, GET); SADD once per
-- bucket per report interval; HGETALL of the parameters only when the bucket key is missing.
-- Lua creates a closure for every function a script defines, on every call, so the decision
-- runs without the shared helpers: it checks arguments, the state and the parameters inline
-- (the same checks as int, bucket_ok and state_decode) and takes the refill and waits in their
-- exact direct forms, with x % y for math.fmod (exact for integers below 2^53), and makes the
-- helpers only for a product past 2^53 or a debt. The minimum TTL goes to SET as the argument
-- string when it has no leading zero (a number argument costs Redis a conversion).

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

-- Arguments. An integer argument is checked inline as int() does (find(s, DIGITS), then s + 0),
-- so the common paths create no closure; an error reply is ERR .. what. The values a daemon
-- sends on most calls (cost and batch 1, the default minimum TTL, a per-second fallback
-- period) are first compared as strings: Lua interns strings, so that is one pointer
-- comparison where the check and the parse (a pattern match and strtod) cost Redis about a
-- thousand instructions.
local keys, argv = KEYS, ARGV
local k1, k2, k3 = keys[1], keys[2], keys[3]
if #keys ~= 3 then
  return redis.error_reply(ERR .. 'expected 3 keys')
end
if k1 == k2 or k1 == k3 or k2 == k3 then
  return redis.error_reply(ERR .. 'the 3 keys must be distinct')
end
local n_args = #argv
if n_args < 3 or n_args > 7 then
  return redis.error_reply(ERR .. 'expected 3 to 7 arguments')
end
local s = argv[1]
local cost = 1
if s ~= '1' then
  cost = #s <= 16 and find(s, DIGITS) and s + 0
  if not cost or cost > MAX_COST then
    return redis.error_reply(ERR .. 'cost must be an integer in 0..' .. MAX_COST)
  end
end
local batch = 1
if n_args == 7 then
  s = argv[7]
  if s ~= '1' then -- a batch of 1 is within every bound (cost is)
    batch = #s <= 16 and find(s, DIGITS) and s + 0
    if not batch or batch < 1 or batch > MAX_COST or cost * batch > MAX_COST then
      return redis.error_reply(ERR .. 'batch must be an integer in 1..' .. MAX_COST
        .. ' with cost * batch at most ' .. MAX_COST)
    end
  end
end
-- The minimum TTL, and as the SET argument the string itself when Redis reads it as given (no
-- leading zero; a number argument costs Redis a conversion).
local min_ttl, min_ttl_arg = DEFAULT_MIN_TTL_MS, DEFAULT_MIN_TTL_ARG
s = argv[5]
if s and s ~= '' and s ~= DEFAULT_MIN_TTL_ARG then
  min_ttl = #s <= 16 and find(s, '^[1-9]%d*$') and s + 0
  if min_ttl then
    min_ttl_arg = s
  else
    min_ttl = #s <= 16 and find(s, DIGITS) and s + 0
    min_ttl_arg = min_ttl
  end
  if not min_ttl or min_ttl < 1 or min_ttl > MAX_CAP then
    return redis.error_reply(ERR .. 'minimum TTL must be an integer number of ms in 1..'
      .. MAX_CAP)
  end
end
local now
s = argv[4]
if s and s ~= '' then
  now = #s <= 16 and find(s, DIGITS) and s + 0
  if not now or now > MAX_CAP then
    return redis.error_reply(ERR .. 'now must be an integer number of ms')
  end
else
  local t = redis.call('TIME')
  local us = t[2] + 0
  now = t[1] * 1000 + (us - us % 1000) / 1000
end

-- pcall: a key of another type is an error reply, not a raised WRONGTYPE (GET answers a string
-- or false otherwise; #v of the error table is 0).
local v = redis.pcall('GET', k1)
local tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per, cper
if v then
  local len = #v
  if len == STATE_LEN then
    tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per =
      struct.unpack(STATE_FMT, v)
  elseif len == STATE_LEN_NO_PERIOD then
    tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate =
      struct.unpack(STATE_FMT_NO_PERIOD, v)
    per = DEFAULT_PERIOD_MS
  elseif type(v) == 'table' then
    return redis.error_reply(ERR .. 'the state key holds another type')
  else
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  -- state_decode's checks, inline. Integers: a sum of fractional parts (each in [0, 1), NaN
  -- for NaN or an infinity) is 0 only when every one is. bucket_ok: floor(cap / rate) * per <
  -- MAX_FILL, which cap * per < MAX_FILL implies (rate >= 1); x % y is exact for integers
  -- below 2^53.
  if not (tokens % 1 + ts % 1 + ad % 1 + dn % 1 + cap % 1 + rate % 1 + per % 1 + carry % 1 == 0
      and tokens >= -MAX_CAP and tokens <= MAX_CAP and ts >= 0 and ts <= MAX_CAP and ad >= 0
      and ad <= MAX_CAP and dn >= 0 and dn <= MAX_CAP and cap >= 0 and cap <= MAX_CAP
      and rate >= 0 and rate <= MAX_CAP and per >= 1 and per <= MAX_PERIOD
      and (rate == 0 or cap * per < MAX_FILL or (cap - cap % rate) / rate * per < MAX_FILL)
      and carry >= 0 and carry < per and (src == 0 or src == 1)
      and ((lease_end == -1 and fcap == 0 and frate == 0) or (lease_end % 1 + fcap % 1
        + frate % 1 == 0 and lease_end >= 0 and lease_end <= MAX_CAP and fcap >= 0
        and fcap <= MAX_CAP and frate >= 0 and frate <= MAX_CAP
        and (frate == 0 or fcap * per < MAX_FILL
          or (fcap - fcap % frate) / frate * per < MAX_FILL)))) then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  cper = per
else
  -- Cold path: the stored parameters, else the fallback. HGETALL: the hash holds at most the
  -- six fields set_params.lua writes, and a missing one costs Redis less than naming them.
  local p = redis.pcall('HGETALL', k2)
  if p.err then
    return redis.error_reply(ERR .. 'the parameters key holds another type')
  end
  lease_end, fcap, frate = -1, 0, 0
  src = 0
  local n_p = #p
  if n_p > 0 then
    local a, b, c, u, f, g -- cap, rate, per, until, fcap, frate
    for i = 1, n_p, 2 do
      local name = p[i]
      if name == 'cap' then
        a = p[i + 1]
      elseif name == 'rate' then
        b = p[i + 1]
      elseif name == 'per' then
        c = p[i + 1]
      elseif name == 'until' then
        u = p[i + 1]
      elseif name == 'fcap' then
        f = p[i + 1]
      elseif name == 'frate' then
        g = p[i + 1]
      end
    end
    if a or b then
      -- int(), opt_int() and bucket_ok(), inline (per '' or absent: 1000).
      cap = a and #a <= 16 and find(a, DIGITS) and a + 0
      rate = b and #b <= 16 and find(b, DIGITS) and b + 0
      per = DEFAULT_PERIOD_MS
      if c and c ~= '' then
        per = #c <= 16 and find(c, DIGITS) and c + 0
      end
      if not (cap and rate and per and cap <= MAX_CAP and rate <= MAX_CAP and per >= 1
          and per <= MAX_PERIOD
          and (rate == 0 or cap * per < MAX_FILL or (cap - cap % rate) / rate * per < MAX_FILL))
      then
        return redis.error_reply(ERR .. 'stored parameters are invalid')
      end
      if u or f or g then
        lease_end = u and #u <= 16 and find(u, DIGITS) and u + 0
        fcap = f and #f <= 16 and find(f, DIGITS) and f + 0
        frate = g and #g <= 16 and find(g, DIGITS) and g + 0
        if not (lease_end and fcap and frate and lease_end <= MAX_CAP and fcap <= MAX_CAP
            and frate <= MAX_CAP and (frate == 0 or fcap * per < MAX_FILL
              or (fcap - fcap % frate) / frate * per < MAX_FILL)) then
          return redis.error_reply(ERR .. 'stored parameters are invalid')
        end
      end
      src = 1
    end
  end
  tokens, carry, ts, ad, dn = false, 0, now, 0, 0
end
if src == 0 then
  -- The fallback, checked only where it is used (stored parameters make it unused): int(),
  -- opt_int() and bucket_ok(), inline.
  local a, b, c = argv[2], argv[3], argv[6]
  if a == '' and b == '' then
    if c ~= nil and c ~= '' then
      return redis.error_reply(ERR .. 'a fallback period needs a fallback capacity and refill')
    end
    return redis.error_reply(ERR .. 'no parameters stored and no fallback given')
  end
  cap = #a <= 16 and find(a, DIGITS) and a + 0
  rate = #b <= 16 and find(b, DIGITS) and b + 0
  per = DEFAULT_PERIOD_MS
  if c and c ~= '' and c ~= DEFAULT_PERIOD_ARG then
    per = #c <= 16 and find(c, DIGITS) and c + 0
  end
  if not (cap and rate and per and cap <= MAX_CAP and rate <= MAX_CAP and per >= 1
      and per <= MAX_PERIOD
      and (rate == 0 or cap * per < MAX_FILL or (cap - cap % rate) / rate * per < MAX_FILL)) then
    return redis.error_reply(ERR
      .. 'fallback capacity, refill and period must be integers within the bucket bounds')
  end
  cper = cper or per
end
if per ~= cper then
  carry = 0 -- counted in another period's units: less than 1 µt, dropped
end
-- The stored parameters pack the lease end with the floor; the fallback has no lease.
local share_cap, share_rate = cap, rate
if src == 1 and lease_end >= 0 and now >= lease_end then
  cap, rate = fcap, frate
end
if not tokens then
  tokens = cap -- a new bucket is full
end

-- refilled(), inline: clipped to cap (and a debt to cap - MAX_CAP), then floor((e * rate +
-- carry) / per) µt added and the remainder carried, directly while e * rate + carry is exact
-- (the helper splits it otherwise).
local h -- the helpers, made only where a product passes 2^53, and in debt
if tokens >= cap then
  tokens, carry = cap, 0
elseif tokens < 0 and tokens < cap - MAX_CAP then
  tokens = cap - MAX_CAP
end
if now > ts then
  if tokens < cap and rate > 0 then
    local n = (now - ts) * rate + carry
    if n > MAX_CAP then
      h = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS, MAX_WINDOW_LIMIT,
        MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD, STATE_FMT,
        STATE_FMT_NO_PERIOD, MAX_WAIT)
      tokens, carry = h.refilled(tokens, carry, ts, cap, rate, per, now)
    else
      local r = n % per
      local add = (n - r) / per
      if add >= cap - tokens then
        tokens, carry = cap, 0
      else
        tokens, carry = tokens + add, r
      end
    end
  end
  ts = now
end

-- The decision (a peek, cost 0, spends nothing), then the waits: time_to(), inline:
-- ceil((need * per - carry) / rate), directly while need * per is exact (the helper corrects a
-- double estimate otherwise, and bounds the long waits of a debt).
local allowed, retry, granted = 1, 0, 0
if cost > 0 then
  local cost_ut = cost * UT
  if cost_ut <= tokens then
    granted = 1
    if batch > 1 then
      granted = (tokens - tokens % cost_ut) / cost_ut
      if granted > batch then
        granted = batch
      end
    end
    tokens = tokens - granted * cost_ut
  elseif cost_ut > cap or rate == 0 then
    allowed, retry = 0, -1
  else
    allowed = 0
    local n = (cost_ut - tokens) * per
    if n > MAX_CAP or tokens < 0 then
      h = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS, MAX_WINDOW_LIMIT,
        MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD, STATE_FMT,
        STATE_FMT_NO_PERIOD, MAX_WAIT)
      retry = h.time_to(cost_ut - tokens, carry, rate, per)
    else
      n = n - carry
      local r = n % rate
      retry = (n - r) / rate
      if r > 0 then
        retry = retry + 1
      end
    end
  end
end
local reset = 0 -- ms until full; -1: never (no refill)
if tokens < cap then
  if rate == 0 then
    reset = -1
  else
    local n = (cap - tokens) * per
    if n > MAX_CAP or tokens < 0 then
      h = h or quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
        MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
        STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
      reset = h.time_to(cap - tokens, carry, rate, per)
    else
      n = n - carry
      local r = n % rate
      reset = (n - r) / rate
      if r > 0 then
        reset = reset + 1
      end
    end
  end
end
local left = 0 -- whole tokens left: none in debt
if tokens > 0 then
  left = (tokens - tokens % UT) / UT
end
if cost == 0 then
  if n_args == 7 then
    return { 1, left, 0, reset, 0 }
  end
  return { 1, left, 0, reset }
end

-- Writes, last: the index (the only write that can fail), then the state. SADD answers 0 or 1,
-- else an error table.
if ad + dn == 0 then
  local r = redis.pcall('SADD', k3, k1)
  if r ~= 1 and r ~= 0 then
    return redis.error_reply(ERR .. 'the activity index holds another type')
  end
end
-- Usage counters saturate at MAX_CAP, so a state stays valid.
if allowed == 1 then
  ad = ad + granted * cost
  if ad > MAX_CAP then
    ad = MAX_CAP
  end
else
  dn = dn + cost
  if dn > MAX_CAP then
    dn = MAX_CAP
  end
end
local packed = struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, share_cap, share_rate, src,
  lease_end, fcap, frate, per)
if reset == -1 then
  -- No refill and not full: expiring would hand out a full bucket, so the key must stay.
  redis.call('SET', k1, packed)
else
  if reset < min_ttl then
    redis.call('SET', k1, packed, 'PX', min_ttl_arg)
  else
    redis.call('SET', k1, packed, 'PX', reset)
  end
end
if n_args == 7 then
  return { allowed, left, retry, reset, granted }
end
return { allowed, left, retry, reset }
