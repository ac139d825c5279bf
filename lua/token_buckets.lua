-- token_buckets.lua: one atomic decision of several token buckets of one subject, all or
-- nothing: the cost is spent on every bucket when every one admits it, and on none otherwise.
--
-- KEYS[2i-1]  limit i's bucket state (string, expires when idle), as KEYS[1] of token_bucket.lua
-- KEYS[2i]    limit i's bucket parameters (hash, no TTL), as KEYS[2] of token_bucket.lua
-- KEYS[2n+1]  activity index (set of state keys decided since the last usage collection)
--             for n limits, 1 <= n <= MAX_LIMITS; every key distinct, all in one hash slot
--             (quotad tags them all {tenant})
-- ARGV[1]     cost in whole tokens for every limit, integer 0..9007199254; 0 is a peek of each
--             (nothing written, nothing counted)
-- ARGV[2]     optional explicit now in ms since the epoch ('': Redis TIME)
-- ARGV[3]     optional minimum idle TTL in ms, integer 1..2^53-1 ('': 60000)
-- ARGV[3i+1]  limit i's fallback capacity in micro-tokens ('' = none), used when no
--             parameters are stored for it, as ARGV[2] of token_bucket.lua
-- ARGV[3i+2]  limit i's fallback refill in micro-tokens per period ('' = none)
-- ARGV[3i+3]  limit i's fallback refill period in ms, integer 1..2678400000 ('': 1000)
-- returns     4n integers, limit by limit: {allowed 0|1, remaining whole tokens (0 in debt),
--             retry_after_ms (-1 = never at these parameters), reset_ms (-1 = never)}; the
--             check is admitted when every allowed is 1. When it is denied, a limit that would
--             have admitted answers allowed 1 with its level unspent.
-- errors      'ERR quotad: <what>' (naming the limit i where one is at fault) for every invalid
--             argument (a fallback only when it is used), repeated key, key of another type,
--             stored parameter or state out of bounds; nothing is written then (every check
--             comes before the first write).
--
-- Each bucket is decided with the arithmetic of token_bucket.lua (quota-core/src/bucket.rs,
-- decide_all is this script; a differential test holds them equal), on one now for all. If
-- every bucket admits, each spends the cost and is written as token_bucket.lua writes it
-- (state, TTL, usage counters, the activity index). If one denies, each bucket that denied is
-- written as a denial of token_bucket.lua (refilled, the cost counted as denied) and the others
-- are not touched at all: a limit that would have admitted spends and counts nothing. A limit
-- in debt (charge.lua) denies, with the wait that covers the repayment, as in token_bucket.lua.
--
-- Cost: TIME (unless now is given), one GET per limit, one SET PX per limit written, one SADD
-- for all the limits first decided in this report interval; HGETALL of a limit's parameters
-- only when its bucket key is missing.

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

-- The common paths run inline, as in token_bucket.lua (see there for why): the checks of
-- int(), opt_int(), bucket_ok() and state_decode(), the refill and the waits in their exact
-- direct forms (x % y for math.fmod), the helpers made only where a product passes 2^53, and
-- each limit's fields kept in an array (one allocation) rather than a table of named fields.
local keys, argv = KEYS, ARGV
local n_keys = #keys
if n_keys < 3 or n_keys % 2 ~= 1 or n_keys > 2 * MAX_LIMITS + 1 then
  return redis.error_reply(ERR .. 'expected 2 keys for each of 1..' .. MAX_LIMITS
    .. ' limits and the activity index')
end
local n = (n_keys - 1) / 2
local index = keys[n_keys]
-- Distinct keys: pairwise for up to 4 limits (no table to allocate), else through a set.
local repeated = false
if n_keys <= 9 then
  for i = 2, n_keys do
    local k = keys[i]
    for j = 1, i - 1 do
      if keys[j] == k then
        repeated = true
      end
    end
  end
else
  local seen = {}
  for i = 1, n_keys do
    local k = keys[i]
    if seen[k] then
      repeated = true
    end
    seen[k] = true
  end
end
if repeated then
  return redis.error_reply(ERR .. 'the ' .. n_keys .. ' keys must be distinct')
end
if #argv ~= 3 + 3 * n then
  return redis.error_reply(ERR .. 'expected ' .. (3 + 3 * n) .. ' arguments for ' .. n
    .. ' limits')
end
-- Cost 1 and the default minimum TTL are compared as strings first (token_bucket.lua).
local s = argv[1]
local cost = 1
if s ~= '1' then
  cost = #s <= 16 and find(s, DIGITS) and s + 0
  if not cost or cost > MAX_COST then
    return redis.error_reply(ERR .. 'cost must be an integer in 0..' .. MAX_COST)
  end
end
local min_ttl, min_ttl_arg = DEFAULT_MIN_TTL_MS, DEFAULT_MIN_TTL_ARG
s = argv[3]
if s ~= '' and s ~= DEFAULT_MIN_TTL_ARG then
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
s = argv[2]
if s ~= '' then
  now = #s <= 16 and find(s, DIGITS) and s + 0
  if not now or now > MAX_CAP then
    return redis.error_reply(ERR .. 'now must be an integer number of ms')
  end
else
  local t = redis.call('TIME')
  local us = t[2] + 0
  now = t[1] * 1000 + (us - us % 1000) / 1000
end

-- Each limit refilled to now, as token_bucket.lua reads it, into buckets[i] = { tokens, carry,
-- ts, ad, dn, cap, rate, per, share_cap, share_rate, src, lease_end, fcap, frate, reset,
-- written }; the last two are filled in by the decision.
local h -- the helpers, made only where a product passes 2^53
local cost_ut = cost * UT
local buckets = {}
local admitted = true
for i = 1, n do
  local v = redis.pcall('GET', keys[2 * i - 1])
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
      return redis.error_reply(ERR .. 'limit ' .. i .. ': the state key holds another type')
    else
      return redis.error_reply(ERR .. 'limit ' .. i .. ': stored state is invalid')
    end
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
      return redis.error_reply(ERR .. 'limit ' .. i .. ': stored state is invalid')
    end
    cper = per
  else
    local p = redis.pcall('HGETALL', keys[2 * i])
    if p.err then
      return redis.error_reply(ERR .. 'limit ' .. i .. ': the parameters key holds another type')
    end
    lease_end, fcap, frate = -1, 0, 0
    src = 0
    local n_p = #p
    if n_p > 0 then
      local a, b, c, u, f, g -- cap, rate, per, until, fcap, frate
      for j = 1, n_p, 2 do
        local name = p[j]
        if name == 'cap' then
          a = p[j + 1]
        elseif name == 'rate' then
          b = p[j + 1]
        elseif name == 'per' then
          c = p[j + 1]
        elseif name == 'until' then
          u = p[j + 1]
        elseif name == 'fcap' then
          f = p[j + 1]
        elseif name == 'frate' then
          g = p[j + 1]
        end
      end
      if a or b then
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
          return redis.error_reply(ERR .. 'limit ' .. i .. ': stored parameters are invalid')
        end
        if u or f or g then
          lease_end = u and #u <= 16 and find(u, DIGITS) and u + 0
          fcap = f and #f <= 16 and find(f, DIGITS) and f + 0
          frate = g and #g <= 16 and find(g, DIGITS) and g + 0
          if not (lease_end and fcap and frate and lease_end <= MAX_CAP and fcap <= MAX_CAP
              and frate <= MAX_CAP and (frate == 0 or fcap * per < MAX_FILL
                or (fcap - fcap % frate) / frate * per < MAX_FILL)) then
            return redis.error_reply(ERR .. 'limit ' .. i .. ': stored parameters are invalid')
          end
        end
        src = 1
      end
    end
    tokens, carry, ts, ad, dn = false, 0, now, 0, 0
  end
  if src == 0 then
    local a, b, c = argv[3 * i + 1], argv[3 * i + 2], argv[3 * i + 3]
    if a == '' and b == '' then
      if c ~= '' then
        return redis.error_reply(ERR .. 'limit ' .. i
          .. ': a fallback period needs a fallback capacity and refill')
      end
      return redis.error_reply(ERR .. 'limit ' .. i
        .. ': no parameters stored and no fallback given')
    end
    cap = #a <= 16 and find(a, DIGITS) and a + 0
    rate = #b <= 16 and find(b, DIGITS) and b + 0
    per = DEFAULT_PERIOD_MS
    if c ~= '' and c ~= DEFAULT_PERIOD_ARG then
      per = #c <= 16 and find(c, DIGITS) and c + 0
    end
    if not (cap and rate and per and cap <= MAX_CAP and rate <= MAX_CAP and per >= 1
        and per <= MAX_PERIOD
        and (rate == 0 or cap * per < MAX_FILL or (cap - cap % rate) / rate * per < MAX_FILL))
    then
      return redis.error_reply(ERR .. 'limit ' .. i .. ': fallback capacity, refill and period '
        .. 'must be integers within the bucket bounds')
    end
    cper = cper or per
  end
  if per ~= cper then
    carry = 0
  end
  local share_cap, share_rate = cap, rate
  if src == 1 and lease_end >= 0 and now >= lease_end then
    cap, rate = fcap, frate
  end
  if not tokens then
    tokens = cap
  end
  -- refilled(), inline (a debt clipped to cap - MAX_CAP).
  if tokens >= cap then
    tokens, carry = cap, 0
  elseif tokens < 0 and tokens < cap - MAX_CAP then
    tokens = cap - MAX_CAP
  end
  if now > ts then
    if tokens < cap and rate > 0 then
      local m = (now - ts) * rate + carry
      if m > MAX_CAP then
        h = h or quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
          MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
          STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
        tokens, carry = h.refilled(tokens, carry, ts, cap, rate, per, now)
      else
        local r = m % per
        local add = (m - r) / per
        if add >= cap - tokens then
          tokens, carry = cap, 0
        else
          tokens, carry = tokens + add, r
        end
      end
    end
    ts = now
  end
  if cost_ut > tokens and cost > 0 then
    admitted = false -- a peek admits, in debt too
  end
  buckets[i] = { tokens, carry, ts, ad, dn, cap, rate, per, share_cap, share_rate, src,
    lease_end, fcap, frate, 0, false }
end

-- Decide each: spend on all when all admit; else deny where it does not, touch nothing else.
-- A peek (cost 0) admits everywhere and writes nothing. out holds 4 fields a limit; listed the
-- state keys to add to the activity index.
local out, listed = {}, nil
for i = 1, n do
  local b = buckets[i]
  local tokens, carry, cap, rate, per = b[1], b[2], b[6], b[7], b[8]
  local allowed, retry, write = 1, 0, cost > 0
  if admitted then
    tokens = tokens - cost_ut
    b[1] = tokens
  elseif cost_ut > tokens then
    if cost_ut > cap or rate == 0 then
      allowed, retry = 0, -1
    else
      -- time_to(), inline: ceil((need * per - carry) / rate).
      allowed = 0
      local m = (cost_ut - tokens) * per
      if m > MAX_CAP or tokens < 0 then
        h = h or quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
          MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
          STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
        retry = h.time_to(cost_ut - tokens, carry, rate, per)
      else
        m = m - carry
        local r = m % rate
        retry = (m - r) / rate
        if r > 0 then
          retry = retry + 1
        end
      end
    end
  else
    write = false -- admits, but another limit denies: untouched
  end
  local reset = 0 -- ms until full; -1: never (no refill)
  if tokens < cap then
    if rate == 0 then
      reset = -1
    else
      local m = (cap - tokens) * per
      if m > MAX_CAP or tokens < 0 then
        h = h or quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
          MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
          STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
        reset = h.time_to(cap - tokens, carry, rate, per)
      else
        m = m - carry
        local r = m % rate
        reset = (m - r) / rate
        if r > 0 then
          reset = reset + 1
        end
      end
    end
  end
  b[15], b[16] = reset, write
  if write and b[4] + b[5] == 0 then
    listed = listed or {}
    listed[#listed + 1] = keys[2 * i - 1]
  end
  local left = 0 -- none in debt
  if tokens > 0 then
    left = (tokens - tokens % UT) / UT
  end
  local k = 4 * i
  out[k - 3], out[k - 2], out[k - 1], out[k] = allowed, left, retry, reset
end
if cost == 0 then
  return out
end

-- Writes, last: the index (the only write that can fail, one SADD for all; it answers the
-- number added, else an error table), then the states.
if listed then
  local r = redis.pcall('SADD', index, unpack(listed))
  if type(r) ~= 'number' then
    return redis.error_reply(ERR .. 'the activity index holds another type')
  end
end
for i = 1, n do
  local b = buckets[i]
  if b[16] then
    local ad, dn = b[4], b[5]
    -- Usage counters saturate at MAX_CAP, so a state stays valid.
    if admitted then
      ad = ad + cost
      if ad > MAX_CAP then
        ad = MAX_CAP
      end
    else
      dn = dn + cost
      if dn > MAX_CAP then
        dn = MAX_CAP
      end
    end
    local packed = struct.pack(STATE_FMT, b[1], b[2], b[3], ad, dn, b[9], b[10], b[11], b[12],
      b[13], b[14], b[8])
    local reset = b[15]
    if reset == -1 then
      redis.call('SET', keys[2 * i - 1], packed)
    elseif reset < min_ttl then
      redis.call('SET', keys[2 * i - 1], packed, 'PX', min_ttl_arg)
    else
      redis.call('SET', keys[2 * i - 1], packed, 'PX', reset)
    end
  end
end
return out
