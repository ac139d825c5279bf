-- set_params.lua: writes a bucket's parameters for quotad's region agent, atomically with the
-- copy of them that token_bucket.lua keeps inside the bucket state.
--
-- KEYS[1]  parameters (hash, no TTL)   qd:v1:{tenant}:<policy>:<version>:p
-- KEYS[2]  token-bucket state (string) qd:v1:{tenant}:<policy>:<version>:b
-- ARGV[1..4]  'cap', capacity µt, 'rate', µt per second     (token bucket)
--          or 'limit', tokens, 'window', ms                  (sliding window)
-- ARGV[5]  optional minimum idle TTL in ms ('' or absent: 60000)
-- ARGV[6]  optional lease: ms from now the parameters hold ('' or absent: no end)
-- ARGV[7], ARGV[8]  with a lease: the floor in force after it, of the same kind as ARGV[1..4]
--          (capacity and rate, or limit and window)
-- ARGV[9]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- returns  1
-- errors   'ERR quotad: <what>' for an invalid argument (token-bucket pairs within the bucket
--          bounds, sliding-window pairs within the window bounds sliding_window.lua applies),
--          repeated keys, a key of another type or an invalid stored state; every check comes
--          before the first write, so nothing is written then.
--
-- The hash is replaced (DEL + HSET): cap, rate [, until, fcap, frate] or limit, window [, until,
-- flimit, fwindow], until = now + lease in this server's clock. The decision scripts enforce
-- the floor from until on by themselves: the region agent renews until once half of it has
-- passed, so a region whose daemon died falls back to its floor when its stored lease ends
-- (at the latest when its lease does) even while gateways keep calling this Redis directly.
--
-- If the token-bucket state exists, its parameter copy is rewritten in place (SET ... KEEPTTL),
-- so the decision script never reads KEYS[1] while the bucket lives: src = 1 for token-bucket
-- parameters, src = 0 (back to each call's fallback) otherwise. The expiry is then lengthened
-- if the parameters in force now need longer to refill the bucket from its stored level (the
-- level only grows with time, so that is an upper bound), and removed if the bucket can no
-- longer refill; it is never shortened. Parameters must be written through this script, never
-- with a bare HSET.

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

if #KEYS ~= 2 or #ARGV < 4 or #ARGV > 9 then
  return err('expected 2 keys and 4 to 9 arguments')
end
if KEYS[1] == KEYS[2] then
  return err('the 2 keys must be distinct')
end
local f1, v1, f2, v2 = ARGV[1], int(ARGV[2], MAX_CAP), ARGV[3], int(ARGV[4], MAX_CAP)
local bucket = f1 == 'cap' and f2 == 'rate'
if not (bucket or (f1 == 'limit' and f2 == 'window')) or v1 == nil or v2 == nil then
  return err('expected cap, rate or limit, window with integer values')
end
-- The pair as the decision script would accept it.
local function pair_ok(a, b)
  if bucket then
    return bucket_ok(a, b)
  end
  return window_ok(a, b)
end
if not pair_ok(v1, v2) then
  if bucket then
    return err('capacity and rate must be integers within the bucket bounds')
  end
  return err('limit and window must be integers within the window bounds')
end
local min_ttl = arg_min_ttl(ARGV[5])
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local lease, g1, g2
if ARGV[6] ~= nil and ARGV[6] ~= '' then
  lease, g1, g2 = int(ARGV[6], MAX_CAP), int(ARGV[7], MAX_CAP), int(ARGV[8], MAX_CAP)
  if lease == nil or g1 == nil or g2 == nil then
    return err('a lease needs integer ms and an integer floor pair')
  end
  if not pair_ok(g1, g2) then
    return err('the floor must be integers within the same bounds as the parameters')
  end
elseif (ARGV[7] ~= nil and ARGV[7] ~= '') or (ARGV[8] ~= nil and ARGV[8] ~= '') then
  return err('a floor needs a lease')
end
local now = arg_now(ARGV[9])
if now == nil then
  return err('now must be an integer number of ms')
end
local lease_end = -1
if lease then
  lease_end = now + lease
  if lease_end > MAX_CAP then
    return err('the lease ends too late')
  end
end

-- Both keys' types and the stored state are checked before the first write.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  return err('the parameters key holds another type')
end
local v = redis.pcall('GET', KEYS[2])
if failed(v) then
  return err('the state key holds another type')
end
local tokens, carry, ts, ad, dn, cap, rate
if v then
  tokens, carry, ts, ad, dn, cap, rate = state_decode(v)
  if tokens == nil then
    return err('stored state is invalid')
  end
end

redis.call('DEL', KEYS[1])
if lease then
  local p1, p2 = 'fcap', 'frate'
  if not bucket then
    p1, p2 = 'flimit', 'fwindow'
  end
  redis.call('HSET', KEYS[1], f1, v1, f2, v2, 'until', lease_end, p1, g1, p2, g2)
else
  redis.call('HSET', KEYS[1], f1, v1, f2, v2)
end

if not v then
  return 1
end
if not bucket then
  redis.call('SET', KEYS[2],
    struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, cap, rate, 0, -1, 0, 0), 'KEEPTTL')
  return 1
end
local fcap, frate = g1 or 0, g2 or 0
redis.call('SET', KEYS[2],
  struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, v1, v2, 1, lease_end, fcap, frate),
  'KEEPTTL')
cap, rate = v1, v2
if lease and now >= lease_end then
  cap, rate = fcap, frate
end
if tokens >= cap then
  return 1
end
if rate == 0 then
  redis.call('PERSIST', KEYS[2])
  return 1
end
local need = time_to(cap - tokens, carry, rate)
if need < min_ttl then
  need = min_ttl
end
local pttl = redis.call('PTTL', KEYS[2])
if pttl >= 0 and pttl < need then
  redis.call('PEXPIRE', KEYS[2], need)
elseif pttl == -1 then
  -- It could not refill under the old parameters; now it can.
  redis.call('PEXPIRE', KEYS[2], need)
end
return 1
