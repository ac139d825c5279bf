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
-- errors   'ERR quotad: <what>' for every invalid argument or stored parameter.
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

local MAX_CAP = 9007199254740991 -- 2^53 - 1
local MAX_RATE = 9007199254740 -- MAX_CAP / 1000
local MAX_FILL_RATIO = 9000000000
local MAX_COST = 9007199254 -- MAX_CAP / UT
local UT = 1000000
local DEFAULT_MIN_TTL_MS = 60000

local fmod = math.fmod
local find = string.find

local function err(what)
  return redis.error_reply('ERR quotad: ' .. what)
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

if #KEYS ~= 3 then
  return err('expected 3 keys')
end
local n_args = #ARGV
if n_args < 3 or n_args > 5 then
  return err('expected 3 to 5 arguments')
end
-- Validation: digits only (no sign, point, exponent, hex or space), at most 16 of them, then
-- numeric bounds. An empty string has no non-digit, so emptiness is checked where it matters.
local a_cost, a_cap, a_rate = ARGV[1], ARGV[2], ARGV[3]
local cost = tonumber(a_cost)
if cost == nil or #a_cost > 16 or find(a_cost, '%D') or cost > MAX_COST then
  return err('cost must be an integer in 0..' .. MAX_COST)
end
local now
local a_now = ARGV[4]
if a_now == nil or a_now == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
else
  now = tonumber(a_now)
  if now == nil or #a_now > 16 or find(a_now, '%D') or now > MAX_CAP then
    return err('now must be an integer number of ms')
  end
end
local min_ttl = DEFAULT_MIN_TTL_MS
local a_ttl = ARGV[5]
if a_ttl ~= nil and a_ttl ~= '' then
  min_ttl = tonumber(a_ttl)
  if min_ttl == nil or #a_ttl > 16 or find(a_ttl, '%D') or min_ttl < 1 or min_ttl > MAX_CAP then
    return err('minimum TTL must be an integer number of ms in 1..9007199254740991')
  end
end
-- A capacity / rate pair (strings) as numbers within the bounds of quota-core
-- BucketParams::new, or nil. floor(cap / rate) >= M  <=>  cap >= M * rate, and the product, even
-- when rounded above 2^53, compares correctly with cap < 2^53.
local function pair(a, b)
  local x, y = tonumber(a), tonumber(b)
  if x == nil or y == nil or #a > 16 or #b > 16 or find(a, '%D') or find(b, '%D')
      or x > MAX_CAP or y > MAX_RATE or (y > 0 and x >= MAX_FILL_RATIO * y) then
    return nil
  end
  return x, y
end

local fb_cap, fb_rate
if a_cap ~= '' or a_rate ~= '' then
  fb_cap, fb_rate = pair(a_cap, a_rate)
  if fb_cap == nil then
    return err('fallback capacity and rate must be integers within the bucket bounds')
  end
end

local v = redis.call('GET', KEYS[1])
local tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate
if v then
  if #v ~= 88 then
    return err('stored state is invalid')
  end
  tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate =
    struct.unpack('<ddddddddddd', v)
else
  -- Cold path: the stored parameters, else the fallback.
  local p = redis.call('HMGET', KEYS[2], 'cap', 'rate', 'until', 'fcap', 'frate')
  lease_end, fcap, frate = -1, 0, 0
  if p[1] or p[2] then
    cap, rate = pair(p[1] or '', p[2] or '')
    if cap == nil then
      return err('stored parameters are invalid')
    end
    if p[3] or p[4] or p[5] then
      lease_end = tonumber(p[3])
      fcap, frate = pair(p[4] or '', p[5] or '')
      if lease_end == nil or fcap == nil or #p[3] > 16 or find(p[3], '%D') then
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

if ad + dn == 0 then
  redis.call('SADD', KEYS[3], KEYS[1])
end
if allowed == 1 then
  ad = ad + cost
else
  dn = dn + cost
end
local packed = struct.pack('<ddddddddddd', tokens, carry, ts, ad, dn, share_cap, share_rate, src,
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
