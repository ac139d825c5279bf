-- charge.lua: charges a token bucket for work already done, into bounded debt (quotad).
--
-- KEYS[1]  bucket state (string, see token_bucket.lua)   qd:v1:{tenant}:<policy>:<version>:b
-- KEYS[2]  bucket parameters (hash, no TTL), as KEYS[2] of token_bucket.lua; read only when
--          KEYS[1] does not exist
-- KEYS[3]  activity index (set of state keys decided since the last usage collection)
-- KEYS[4]  optional: this charge's marker, unique per charge, in KEYS[1]'s slot
--          (qd:v1:{tenant}:<policy>:<version>:b:g:<id>)
-- ARGV[1]  cost in whole tokens, integer 1..9007199254
-- ARGV[2]  debt limit in micro-tokens: how far below empty the charge may take the bucket,
--          integer 0..2^53-1, with the capacity in force plus the limit at most 2^53-1
-- ARGV[3]  fallback capacity in micro-tokens, used when no parameters are stored ('' = none)
-- ARGV[4]  fallback refill in micro-tokens per period ('' = none; given together with ARGV[3])
-- ARGV[5]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- ARGV[6]  optional minimum idle TTL in ms, integer 1..2^53-1 ('' or absent: 60000)
-- ARGV[7]  optional fallback refill period in ms, integer 1..2678400000 ('' or absent: 1000)
-- returns  {applied, clamped, remaining, debt, retry_after_ms, reset_ms}: whole tokens taken;
--          whole tokens not taken because the debt limit was reached (applied + clamped =
--          cost); whole tokens left (0 in debt); whole tokens owed (rounded up); ms until a
--          check of one token is admitted (-1 = never at these parameters); ms until full
--          (-1 = never)
-- errors   'ERR quotad: <what>' for every invalid argument (the fallback only when it is used),
--          a debt limit too large for the capacity in force, repeated key, key of another
--          type, stored parameter, state or marker out of bounds, a marker of another cost;
--          nothing is written then
--          (every check comes before the first write).
--
-- The arithmetic is quota-core bucket::charge exactly (a differential test holds them equal).
-- The bucket is read and refilled to now as token_bucket.lua reads it (the copy of the
-- parameters in the state, else the stored ones, else the fallback; the floor's from the lease
-- end on), then takes min(cost, floor((level + debt limit) / UT)) whole tokens: its level may
-- go below 0, never below -debt limit, and the rest is clamped (not taken, reported). A bucket
-- already deeper in debt than the limit (a lower limit since) takes nothing. While the level
-- is below a check's cost, token_bucket.lua and token_buckets.lua deny it, with the wait that
-- covers the repayment; the refill and refund.lua repay the debt first. A capacity plus limit
-- of at most 2^53 - 1 keeps every level and need exact (see token_bucket.lua, Debt).
--
-- Usage: the tokens applied count as admitted (ad: demand the bucket met), the clamped ones as
-- denied (dn: demand it did not), and the key is listed in the activity index as a decision
-- lists it. The state is written with SET ... PX max(time to full, minimum idle TTL), as
-- token_bucket.lua writes it, so it never expires before it would be full, from a debt too
-- (and never when that is beyond MAX_WAIT, or the bucket does not refill).
--
-- Exactly once: a charge is not idempotent, and a call can run twice (a connection that broke
-- after Redis ran the script, retried by the daemon or by the Cluster client, or a client
-- retrying one charge under its id). With KEYS[4] the first run stores what it applied and
-- clamped there ('<applied>:<clamped>', for ONCE_MS), and a run that finds them changes nothing
-- and answers them with the bucket as it stands now; a run of another cost is refused (an id
-- names one charge).

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
if n_keys ~= 3 and n_keys ~= 4 then
  return err('expected 3 or 4 keys')
end
for i = 1, n_keys do
  for j = i + 1, n_keys do
    if KEYS[i] == KEYS[j] then
      return err('the ' .. n_keys .. ' keys must be distinct')
    end
  end
end
if #ARGV < 4 or #ARGV > 7 then
  return err('expected 4 to 7 arguments')
end
local cost = int(ARGV[1], MAX_COST)
if cost == nil or cost < 1 then
  return err('cost must be an integer in 1..' .. MAX_COST)
end
local limit = int(ARGV[2], MAX_CAP)
if limit == nil then
  return err('the debt limit must be an integer number of micro-tokens below 2^53')
end
local min_ttl = opt_int(ARGV[6], DEFAULT_MIN_TTL_MS, MAX_CAP)
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local now = arg_now(ARGV[5])
if now == nil then
  return err('now must be an integer number of ms')
end

-- The bucket as token_bucket.lua reads it: its state, else the stored parameters (a new,
-- full bucket), else the fallback.
local v = redis.pcall('GET', KEYS[1])
if failed(v) then
  return err('the state key holds another type')
end
local tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per, cper
if v then
  tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per = state_decode(v)
  if tokens == nil then
    return err('stored state is invalid')
  end
  cper = per
else
  local p = redis.pcall('HGETALL', KEYS[2])
  if failed(p) then
    return err('the parameters key holds another type')
  end
  local f = {}
  for i = 1, #p, 2 do
    f[p[i]] = p[i + 1]
  end
  lease_end, fcap, frate, src = -1, 0, 0, 0
  if f.cap or f.rate then
    cap, rate = int(f.cap, MAX_CAP), int(f.rate, MAX_CAP)
    per = opt_int(f.per, DEFAULT_PERIOD_MS, MAX_PERIOD)
    if not bucket_ok(cap, rate, per) then
      return err('stored parameters are invalid')
    end
    if f['until'] or f.fcap or f.frate then
      lease_end, fcap, frate = int(f['until'], MAX_CAP), int(f.fcap, MAX_CAP), int(f.frate,
        MAX_CAP)
      if lease_end == nil or not bucket_ok(fcap, frate, per) then
        return err('stored parameters are invalid')
      end
    end
    src = 1
  end
  carry, ts, ad, dn = 0, now, 0, 0
end
if src == 0 then
  -- The fallback, checked only where it is used.
  local a, b, c = ARGV[3], ARGV[4], ARGV[7]
  if a == '' and b == '' then
    if c ~= nil and c ~= '' then
      return err('a fallback period needs a fallback capacity and refill')
    end
    return err('no parameters stored and no fallback given')
  end
  cap, rate, per = int(a, MAX_CAP), int(b, MAX_CAP), opt_int(c, DEFAULT_PERIOD_MS, MAX_PERIOD)
  if not bucket_ok(cap, rate, per) then
    return err('fallback capacity, refill and period must be integers within the bucket bounds')
  end
  cper = cper or per
end
if per ~= cper then
  carry = 0 -- counted in another period's units: less than 1 µt, dropped
end
local ecap, erate = cap, rate -- in force now: the floor's from the lease end on
if src == 1 and lease_end >= 0 and now >= lease_end then
  ecap, erate = fcap, frate
end
if limit > MAX_CAP - ecap then
  return err('the capacity in force plus the debt limit must be at most 2^53 - 1 micro-tokens')
end
-- A replay: what the first run applied and clamped.
local applied, clamped
if KEYS[4] then
  local m = redis.pcall('GET', KEYS[4])
  if failed(m) then
    return err('the charge marker holds another type')
  end
  if m then
    local a, c = string.match(m, '^(%d+):(%d+)$')
    applied, clamped = int(a, MAX_COST), int(c, MAX_COST)
    if applied == nil or clamped == nil then
      return err('the charge marker holds something else')
    end
    if applied + clamped ~= cost then
      return err('the charge id was used for a charge of another cost')
    end
  end
end

if not v then
  tokens = ecap -- a new bucket is full
end
tokens, carry, ts = refilled(tokens, carry, ts, ecap, erate, per, now)
local replay = applied ~= nil
if not replay then
  -- level + limit <= cap + limit <= MAX_CAP: exact.
  local room = tokens + limit
  applied = 0
  if room > 0 then
    applied = (room - fmod(room, UT)) / UT
    if applied > cost then
      applied = cost
    end
  end
  tokens = tokens - applied * UT
  clamped = cost - applied
end

-- The bucket it leaves: tokens left or owed, the wait for one token, the time to full.
local left, owed = 0, 0
if tokens > 0 then
  left = (tokens - fmod(tokens, UT)) / UT
elseif tokens < 0 then
  local r = fmod(-tokens, UT)
  owed = (-tokens - r) / UT
  if r > 0 then
    owed = owed + 1
  end
end
local retry = 0
if tokens < UT then
  if ecap < UT or erate == 0 then
    retry = -1
  else
    retry = time_to(UT - tokens, carry, erate, per)
  end
end
local reset = 0
if tokens < ecap then
  if erate == 0 then
    reset = -1
  else
    reset = time_to(ecap - tokens, carry, erate, per)
  end
end
if replay then
  return { applied, clamped, left, owed, retry, reset }
end

-- Writes, last: the index (the only write that can fail), the state, the marker.
if ad + dn == 0 then
  if failed(redis.pcall('SADD', KEYS[3], KEYS[1])) then
    return err('the activity index holds another type')
  end
end
-- Usage counters saturate at MAX_CAP, so a state stays valid.
ad = ad + applied
if ad > MAX_CAP then
  ad = MAX_CAP
end
dn = dn + clamped
if dn > MAX_CAP then
  dn = MAX_CAP
end
local packed = struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap,
  frate, per)
if reset == -1 then
  -- Full never, or not within MAX_WAIT: expiring would hand out a full bucket.
  redis.call('SET', KEYS[1], packed)
elseif reset < min_ttl then
  redis.call('SET', KEYS[1], packed, 'PX', min_ttl)
else
  redis.call('SET', KEYS[1], packed, 'PX', reset)
end
if KEYS[4] then
  redis.call('SET', KEYS[4], string.format('%d:%d', applied, clamped), 'PX', ONCE_MS)
end
return { applied, clamped, left, owed, retry, reset }
