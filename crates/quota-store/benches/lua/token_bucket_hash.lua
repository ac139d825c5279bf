-- REJECTED DESIGN, kept only as a benchmark comparison: a hash-based token bucket (state and
-- parameters in hashes: HMGET params + HMGET/HSET state + PEXPIRE with slack). quotad does not
-- use it and its contract below is not maintained; lua/token_bucket.lua (one packed string) is
-- the design in use. benches/store.rs runs it beside the real script to show the difference.
-- token_bucket_hash.lua: one atomic token-bucket decision in hashes (rejected design).
--
-- KEYS[1]  bucket state (hash, expires when idle)  qd:v1:{tenant}:<policy>:<version>:b
-- KEYS[2]  bucket parameters (hash, no TTL)        qd:v1:{tenant}:<policy>:<version>:p
--          fields: cap (capacity, micro-tokens), rate (refill, micro-tokens per second)
-- KEYS[3]  activity index (set of state keys decided since the last usage collection)
-- ARGV[1]  cost in whole tokens, integer 1..9007199254
-- ARGV[2]  fallback capacity in micro-tokens, used when KEYS[2] holds no parameters ('' = none)
-- ARGV[3]  fallback refill in micro-tokens per second ('' = none; given together with ARGV[2])
-- ARGV[4]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- returns  {allowed 0|1, remaining whole tokens, retry_after_ms (-1 = never at these
--           parameters), reset_ms (ms until full, -1 = never)}
-- errors   'ERR quotad: <what>' for every invalid argument or stored parameter.
--
-- The arithmetic is quota-core/src/bucket.rs exactly (a differential test holds them equal):
-- integer micro-tokens, a carry in thousandths of a micro-token, whole milliseconds. Lua numbers
-- are doubles, so every intermediate is kept below 2^53: products that could exceed it are
-- split, and divisions use math.fmod, which is exact.
--
-- State fields: t tokens (µt), c carry, ts latest time seen (ms), ad / dn tokens admitted /
-- denied since the last collection, x the expiry deadline last set (ms, or 'inf' when the key
-- must not expire). The key is listed in the activity index exactly while ad + dn > 0: every
-- decision adds at least 1 and a collection zeroes both, so only the first decision of each
-- report interval pays the SADD.
--
-- Cost: TIME (unless now is given), two HMGETs and one HSET per decision; SADD once per bucket
-- per report interval; PEXPIRE only when the needed deadline passes the one set (slack: a
-- quarter of the TTL). Numbers go to redis.call as Lua numbers: Redis formats them with %.17g,
-- exact for integers below 2^53.

local MAX_CAP = 9007199254740991 -- 2^53 - 1
local MAX_RATE = 9007199254740 -- MAX_CAP / 1000
local MAX_FILL_RATIO = 9000000000
local MAX_COST = 9007199254 -- MAX_CAP / UT
local UT = 1000000
local MIN_TTL_MS = 1000 -- keeps usage counters until the next collection
local MAX_SLACK_MS = 3600000

local fmod = math.fmod
local find = string.find

-- The hot path below checks every argument's shape with one pattern; this slow path runs only
-- when that fails, to name the offending argument. Never a silent default.
local function bad_argument(a_cost, a_cap, a_rate, a_now)
  local function int(s, max)
    if #s == 0 or #s > 16 or not find(s, '^%d+$') then
      return nil
    end
    local n = tonumber(s)
    if n > max then
      return nil
    end
    return n
  end
  local cost = int(a_cost, MAX_COST)
  if cost == nil or cost < 1 then
    return redis.error_reply('ERR quotad: cost must be an integer in 1..' .. MAX_COST)
  end
  if a_now ~= '' and int(a_now, MAX_CAP) == nil then
    return redis.error_reply('ERR quotad: now must be an integer number of ms')
  end
  return redis.error_reply(
    'ERR quotad: fallback capacity and rate must be integers within the bucket bounds')
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
  return redis.error_reply('ERR quotad: expected 3 keys')
end
local n_args = #ARGV
if n_args < 3 or n_args > 4 then
  return redis.error_reply('ERR quotad: expected 3 or 4 arguments')
end
local a_cost, a_cap, a_rate, a_now = ARGV[1], ARGV[2], ARGV[3], ARGV[4] or ''
if #a_cost > 16 or #a_cap > 16 or #a_rate > 16 or #a_now > 16
    or not find(a_cost .. ',' .. a_cap .. ',' .. a_rate .. ',' .. a_now, '^%d+,%d*,%d*,%d*$') then
  return bad_argument(a_cost, a_cap, a_rate, a_now)
end
local cost = tonumber(a_cost)
if cost < 1 or cost > MAX_COST then
  return bad_argument(a_cost, a_cap, a_rate, a_now)
end
-- Bounds of quota-core BucketParams::new. floor(cap / rate) >= M  <=>  cap >= M * rate, and the
-- product, even when rounded above 2^53, compares correctly with cap < 2^53.
local fb_cap, fb_rate
if a_cap ~= '' or a_rate ~= '' then
  fb_cap, fb_rate = tonumber(a_cap), tonumber(a_rate)
  if fb_cap == nil or fb_rate == nil or fb_cap > MAX_CAP or fb_rate > MAX_RATE
      or (fb_rate > 0 and fb_cap >= MAX_FILL_RATIO * fb_rate) then
    return bad_argument(a_cost, a_cap, a_rate, a_now)
  end
end
local now
if a_now == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
else
  now = tonumber(a_now)
  if now > MAX_CAP then
    return bad_argument(a_cost, a_cap, a_rate, a_now)
  end
end

local cap, rate
local p = redis.call('HMGET', KEYS[2], 'cap', 'rate')
local p_cap, p_rate = p[1], p[2]
if p_cap or p_rate then
  if not (p_cap and p_rate) or #p_cap > 16 or #p_rate > 16
      or not find(p_cap .. ',' .. p_rate, '^%d+,%d+$') then
    return redis.error_reply('ERR quotad: stored parameters are invalid')
  end
  cap, rate = tonumber(p_cap), tonumber(p_rate)
  if cap > MAX_CAP or rate > MAX_RATE or (rate > 0 and cap >= MAX_FILL_RATIO * rate) then
    return redis.error_reply('ERR quotad: stored parameters are invalid')
  end
elseif fb_cap then
  cap, rate = fb_cap, fb_rate
else
  return redis.error_reply('ERR quotad: no parameters stored and no fallback given')
end

local h = redis.call('HMGET', KEYS[1], 't', 'c', 'ts', 'ad', 'dn', 'x')
local tokens, carry, ts
if h[1] then
  tokens, carry, ts = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])
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
else
  tokens, carry, ts = cap, 0, now
end

local cost_ut = cost * UT
local allowed, retry
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

local ad, dn = tonumber(h[4]) or 0, tonumber(h[5]) or 0
if ad + dn == 0 then
  redis.call('SADD', KEYS[3], KEYS[1])
end
if allowed == 1 then
  ad = ad + cost
else
  dn = dn + cost
end
-- Expiry: at least the time to refill completely (an expired bucket reads as full), moved only
-- when the needed deadline passes the one set, with slack so a hot key rarely pays PEXPIRE.
-- No refill and not full: expiring would hand out a full bucket, so the key must stay.
local x
if reset == -1 then
  if h[6] ~= 'inf' then
    x = 'inf'
  end
else
  local ttl = reset
  if ttl < MIN_TTL_MS then
    ttl = MIN_TTL_MS
  end
  local set = tonumber(h[6])
  if set == nil or now + ttl > set then
    local slack = (ttl - ttl % 4) / 4 -- exact: division by a power of two
    if slack > MAX_SLACK_MS then
      slack = MAX_SLACK_MS
    end
    x = ttl + slack
  end
end
if x == nil then
  redis.call('HSET', KEYS[1], 't', tokens, 'c', carry, 'ts', ts, 'ad', ad, 'dn', dn)
elseif x == 'inf' then
  redis.call('HSET', KEYS[1], 't', tokens, 'c', carry, 'ts', ts, 'ad', ad, 'dn', dn, 'x', x)
  redis.call('PERSIST', KEYS[1])
else
  redis.call('HSET', KEYS[1], 't', tokens, 'c', carry, 'ts', ts, 'ad', ad, 'dn', dn, 'x', now + x)
  redis.call('PEXPIRE', KEYS[1], x)
end
return { allowed, (tokens - fmod(tokens, UT)) / UT, retry, reset }
