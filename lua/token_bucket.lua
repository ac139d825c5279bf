-- token_bucket.lua: one atomic token-bucket decision for quotad.
--
-- KEYS[1]  bucket state (string, expires when idle)  qd:v1:{tenant}:<policy>:<version>:b
-- KEYS[2]  bucket parameters (hash, no TTL)          qd:v1:{tenant}:<policy>:<version>:p
--          fields: cap (capacity, micro-tokens), rate (refill, micro-tokens per second), and
--          with a lease end: until (ms, this server's clock), fcap / frate (the floor, in force
--          from until on); written by set_params.lua, read here only when KEYS[1] does not exist
-- KEYS[3]  activity index (set of state keys decided since the last usage collection)
-- ARGV[1]  cost in whole tokens, integer 0..9007199254; 0 is a peek: the bucket's level now,
--          nothing written, nothing counted (returns allowed 1, retry 0)
-- ARGV[2]  fallback capacity in micro-tokens, used when no parameters are stored ('' = none)
-- ARGV[3]  fallback refill in micro-tokens per second ('' = none; given together with ARGV[2])
-- ARGV[4]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- ARGV[5]  optional minimum idle TTL in ms, integer 1..2^53-1 ('' or absent: 60000); keeps the
--          usage counters of an idle bucket until the next collection
-- returns  {allowed 0|1, remaining whole tokens, retry_after_ms (-1 = never at these
--           parameters), reset_ms (ms until full, -1 = never)}
-- errors   'ERR quotad: <what>' for every invalid argument, repeated key, key of another type,
--          stored parameter or state out of bounds; nothing is written then (every check
--          comes before the first write).
--
-- The arithmetic is quota-core/src/bucket.rs exactly (a differential test holds them equal):
-- integer micro-tokens, a carry in thousandths of a micro-token, whole milliseconds. Lua numbers
-- are doubles, so every intermediate is kept below 2^53: products that could exceed it are
-- split, and divisions use math.fmod, which is exact.
--
-- State: ONE string, struct.pack('<ddddddddddd', t, c, ts, ad, dn, cap, rate, src, until, fcap,
-- frate) (88 bytes, little-endian doubles, exact for integers below 2^53): t tokens (µt), c
-- carry, ts latest time seen (ms), ad / dn tokens admitted / denied since the last collection,
-- cap / rate the parameters, src 1 when cap / rate are a copy of the stored parameters (KEYS[2])
-- or 0 when they came from the fallback (then this call's fallback applies, as the reference
-- does), until the lease end (-1 = none) after which fcap / frate are in force instead.
-- set_params.lua rewrites the copy when the parameters change, so the hot path never reads
-- KEYS[2].
--
-- Lease end: a region's share holds only while its daemon's lease does. The daemon rewrites
-- the parameters when they change and renews until once half of it has passed; if the daemon
-- dies, this script alone drops the bucket to the floor at until, so share the coordinator
-- gives elsewhere is never held twice.
--
-- Activity index: the key is listed exactly while ad + dn > 0: every decision adds at least 1
-- and a collection zeroes both, so only the first decision of each report interval pays the
-- SADD.
--
-- Expiry: every decision writes the state with SET ... PX max(time to refill fully, minimum
-- idle TTL): an expired bucket reads as full, so it must not expire before it would be full.
-- With no refill and not full, the SET carries no expiry (the key must stay).
--
-- Cost: TIME (unless now is given), GET, SET PX per decision (a peek: TIME, GET); SADD once per
-- bucket per report interval; HMGET of the parameters only when the bucket key is missing.

-- quotad shared helpers: begin. The same text in every script in lua/ (each script runs on its
-- own, so the helpers are copied, not included); a test holds the copies equal and the bounds
-- equal to quota-core's bounds.rs.
local UT = 1000000 -- micro-tokens per token
local MAX_CAP = 9007199254740991 -- 2^53 - 1: capacities in µt, times and TTLs in ms
local MAX_RATE = 9007199254740 -- MAX_CAP / 1000: refill in µt per second
local MAX_FILL_RATIO = 9000000000 -- floor(capacity / rate) stays below this
local MAX_COST = 9007199254 -- MAX_CAP / UT: whole tokens per call
local MAX_WINDOW_LIMIT = 1000000000 -- sliding-window limit in tokens
local MAX_WINDOW_MS = 2678400000 -- longest window: 31 days
local MAX_WINDOW_PRODUCT = 2251799813685248 -- 2^51: largest limit * window
local EXACT_LOG_MAX = 128 -- largest sliding-window limit kept as an exact log
local DEFAULT_MIN_TTL_MS = 60000 -- minimum idle TTL when none is given
local COLLECT_MAX = 100000 -- most keys one usage collection takes
local STATE_LEN = 88 -- bytes of a token-bucket state
-- Token-bucket state: 11 little-endian doubles (exact for integers below 2^53): tokens (µt),
-- carry (thousandths of a µt), ts (latest ms seen), ad / dn (tokens admitted / denied since the
-- last collection, bytes 25..40), cap, rate, src, until, fcap, frate (see token_bucket.lua).
local STATE_FMT = '<ddddddddddd'

local fmod = math.fmod
local find = string.find

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

-- Redis TIME in whole ms since the epoch.
local function time_ms()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + (us - fmod(us, 1000)) / 1000
end

-- An optional explicit now in ms ('' or absent: Redis TIME); nil when invalid.
local function arg_now(s)
  if s == nil or s == '' then
    return time_ms()
  end
  return int(s, MAX_CAP)
end

-- An optional minimum idle TTL in ms ('' or absent: the default); nil when invalid.
local function arg_min_ttl(s)
  if s == nil or s == '' then
    return DEFAULT_MIN_TTL_MS
  end
  local n = int(s, MAX_CAP)
  if n == nil or n < 1 then
    return nil
  end
  return n
end

-- A usage counter after adding cost: saturates at MAX_CAP, so a state stays valid.
local function add_usage(n, cost)
  n = n + cost
  if n > MAX_CAP then
    return MAX_CAP
  end
  return n
end

-- A reply that is a Redis error (redis.pcall), e.g. WRONGTYPE: the key holds another type.
local function failed(r)
  return type(r) == 'table' and r.err ~= nil
end

-- Token-bucket parameters within the bounds of quota-core BucketParams::new. floor(cap / rate)
-- >= M <=> cap >= M * rate, and the product, even rounded above 2^53, compares correctly.
-- x % 1 == 0 is false for NaN and infinities.
local function bucket_ok(cap, rate)
  return cap ~= nil and rate ~= nil and cap % 1 == 0 and rate % 1 == 0 and cap >= 0
    and cap <= MAX_CAP and rate >= 0 and rate <= MAX_RATE
    and not (rate > 0 and cap >= MAX_FILL_RATIO * rate)
end

-- Sliding-window parameters within the bounds of quota-core WindowParams::new (integers).
local function window_ok(limit, w)
  return limit ~= nil and w ~= nil and limit <= MAX_WINDOW_LIMIT and w >= 1
    and w <= MAX_WINDOW_MS and limit * w <= MAX_WINDOW_PRODUCT
end

-- The fields of a token-bucket state, or nil when v is not one (wrong length, NaN, a fraction
-- or a value out of bounds): tokens, carry, ts, ad, dn, cap, rate, src, until, fcap, frate.
local function state_decode(v)
  if #v ~= STATE_LEN then
    return nil
  end
  local t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate = struct.unpack(STATE_FMT, v)
  if t % 1 == 0 and t >= 0 and t <= MAX_CAP and c % 1 == 0 and c >= 0 and c < 1000
      and ts % 1 == 0 and ts >= 0 and ts <= MAX_CAP and ad % 1 == 0 and ad >= 0
      and ad <= MAX_CAP and dn % 1 == 0 and dn >= 0 and dn <= MAX_CAP
      and bucket_ok(cap, rate) and (src == 0 or src == 1)
      and (lease_end == -1 or (lease_end % 1 == 0 and lease_end >= 0 and lease_end <= MAX_CAP))
      and bucket_ok(fcap, frate) then
    return t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate
  end
  return nil
end

-- v (a valid state) with its usage counters ad / dn zeroed.
local function state_without_usage(v)
  return v:sub(1, 24) .. struct.pack('<dd', 0, 0) .. v:sub(41)
end

-- ceil((need * 1000 - carry) / rate) without forming need * 1000 (fmod is exact).
local function time_to(need, carry, rate)
  local r = fmod(need, rate)
  local n = r * 1000 - carry
  local m = fmod(n, rate)
  local d = (n - m) / rate
  if m > 0 then
    d = d + 1
  end
  return (need - r) / rate * 1000 + d
end
-- quotad shared helpers: end.

if #KEYS ~= 3 then
  return err('expected 3 keys')
end
if KEYS[1] == KEYS[2] or KEYS[1] == KEYS[3] or KEYS[2] == KEYS[3] then
  return err('the 3 keys must be distinct')
end
local n_args = #ARGV
if n_args < 3 or n_args > 5 then
  return err('expected 3 to 5 arguments')
end
local cost = int(ARGV[1], MAX_COST)
if cost == nil then
  return err('cost must be an integer in 0..' .. MAX_COST)
end
local min_ttl = arg_min_ttl(ARGV[5])
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local now = arg_now(ARGV[4])
if now == nil then
  return err('now must be an integer number of ms')
end

local fb_cap, fb_rate
if ARGV[2] ~= '' or ARGV[3] ~= '' then
  fb_cap, fb_rate = int(ARGV[2], MAX_CAP), int(ARGV[3], MAX_RATE)
  if not bucket_ok(fb_cap, fb_rate) then
    return err('fallback capacity and rate must be integers within the bucket bounds')
  end
end

-- pcall: a key of another type is an error reply, not a raised WRONGTYPE.
local v = redis.pcall('GET', KEYS[1])
if failed(v) then
  return err('the state key holds another type')
end
local tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate
if v then
  tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate = state_decode(v)
  if tokens == nil then
    return err('stored state is invalid')
  end
else
  -- Cold path: the stored parameters, else the fallback.
  local p = redis.pcall('HMGET', KEYS[2], 'cap', 'rate', 'until', 'fcap', 'frate')
  if failed(p) then
    return err('the parameters key holds another type')
  end
  lease_end, fcap, frate = -1, 0, 0
  if p[1] or p[2] then
    cap, rate = int(p[1], MAX_CAP), int(p[2], MAX_RATE)
    if not bucket_ok(cap, rate) then
      return err('stored parameters are invalid')
    end
    if p[3] or p[4] or p[5] then
      lease_end, fcap, frate = int(p[3], MAX_CAP), int(p[4], MAX_CAP), int(p[5], MAX_RATE)
      if lease_end == nil or not bucket_ok(fcap, frate) then
        return err('stored parameters are invalid')
      end
    end
    src = 1
  else
    cap, rate, src = 0, 0, 0
  end
  tokens, carry, ts, ad, dn = -1, 0, now, 0, 0
end
if src == 0 then
  if fb_cap == nil then
    return err('no parameters stored and no fallback given')
  end
  cap, rate = fb_cap, fb_rate
end
-- The stored parameters pack the lease end with the floor; the fallback has no lease.
local share_cap, share_rate = cap, rate
if src == 1 and lease_end >= 0 and now >= lease_end then
  cap, rate = fcap, frate
end
if tokens < 0 then
  tokens = cap -- a new bucket is full
end
if tokens >= cap then
  tokens, carry = cap, 0
end
if now > ts then
  if tokens < cap and rate > 0 then
    local elapsed = now - ts
    if elapsed >= time_to(cap - tokens, carry, rate) then
      tokens, carry = cap, 0
    else
      -- elapsed = e1 * 1000 + e0, so elapsed * rate never has to be formed.
      local e0 = fmod(elapsed, 1000)
      local part = e0 * rate + carry
      local c0 = fmod(part, 1000)
      tokens = tokens + (elapsed - e0) / 1000 * rate + (part - c0) / 1000
      carry = c0
    end
  end
  ts = now
end

local cost_ut = cost * UT
local allowed, retry
if cost == 0 then
  local reset = -1
  if tokens >= cap then
    reset = 0
  elseif rate > 0 then
    reset = time_to(cap - tokens, carry, rate)
  end
  return { 1, (tokens - fmod(tokens, UT)) / UT, 0, reset }
end
if cost_ut <= tokens then
  tokens = tokens - cost_ut
  allowed, retry = 1, 0
elseif cost_ut > cap or rate == 0 then
  allowed, retry = 0, -1
else
  allowed, retry = 0, time_to(cost_ut - tokens, carry, rate)
end
local reset
if tokens >= cap then
  reset = 0
elseif rate == 0 then
  reset = -1
else
  reset = time_to(cap - tokens, carry, rate)
end

-- Writes, last: the index (the only write that can fail), then the state.
if ad + dn == 0 and failed(redis.pcall('SADD', KEYS[3], KEYS[1])) then
  return err('the activity index holds another type')
end
if allowed == 1 then
  ad = add_usage(ad, cost)
else
  dn = add_usage(dn, cost)
end
local packed = struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, share_cap, share_rate, src,
  lease_end, fcap, frate)
if reset == -1 then
  -- No refill and not full: expiring would hand out a full bucket, so the key must stay.
  redis.call('SET', KEYS[1], packed)
else
  local ttl = reset
  if ttl < min_ttl then
    ttl = min_ttl
  end
  redis.call('SET', KEYS[1], packed, 'PX', ttl)
end
return { allowed, (tokens - fmod(tokens, UT)) / UT, retry, reset }
