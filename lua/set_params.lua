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
-- errors   'ERR quotad: <what>' for an invalid argument; nothing is written then.
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

local MAX_CAP = 9007199254740991
local MAX_RATE = 9007199254740
local MAX_FILL_RATIO = 9000000000
local fmod = math.fmod

local function err(what)
  return redis.error_reply('ERR quotad: ' .. what)
end

local function int(s)
  if type(s) ~= 'string' or #s == 0 or #s > 16 or string.find(s, '%D') then
    return nil
  end
  return tonumber(s)
end

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

local function bucket_ok(cap, rate)
  return cap ~= nil and rate ~= nil and cap <= MAX_CAP and rate <= MAX_RATE
    and not (rate > 0 and cap >= MAX_FILL_RATIO * rate)
end

if #KEYS ~= 2 or #ARGV < 4 or #ARGV > 9 then
  return err('expected 2 keys and 4 to 9 arguments')
end
local f1, v1, f2, v2 = ARGV[1], int(ARGV[2]), ARGV[3], int(ARGV[4])
local bucket = f1 == 'cap' and f2 == 'rate'
if not (bucket or (f1 == 'limit' and f2 == 'window')) or v1 == nil or v2 == nil then
  return err('expected cap, rate or limit, window with integer values')
end
if bucket and not bucket_ok(v1, v2) then
  return err('capacity and rate must be integers within the bucket bounds')
end
local min_ttl = 60000
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  min_ttl = int(ARGV[5])
  if min_ttl == nil or min_ttl < 1 or min_ttl > MAX_CAP then
    return err('minimum TTL must be an integer number of ms')
  end
end
local lease, g1, g2
if ARGV[6] ~= nil and ARGV[6] ~= '' then
  lease, g1, g2 = int(ARGV[6]), int(ARGV[7]), int(ARGV[8])
  if lease == nil or lease > MAX_CAP or g1 == nil or g2 == nil then
    return err('a lease needs integer ms and an integer floor pair')
  end
  if bucket and not bucket_ok(g1, g2) then
    return err('the floor capacity and rate must be integers within the bucket bounds')
  end
elseif (ARGV[7] ~= nil and ARGV[7] ~= '') or (ARGV[8] ~= nil and ARGV[8] ~= '') then
  return err('a floor needs a lease')
end
local now
if ARGV[9] == nil or ARGV[9] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
else
  now = int(ARGV[9])
  if now == nil or now > MAX_CAP then
    return err('now must be an integer number of ms')
  end
end
local lease_end = -1
if lease then
  lease_end = now + lease
  if lease_end > MAX_CAP then
    return err('the lease ends too late')
  end
end

local v = redis.call('GET', KEYS[2])
if v and #v ~= 88 then
  return err('stored state is invalid')
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
local tokens, carry, ts, ad, dn, cap, rate = struct.unpack('<ddddddd', v)
if not bucket then
  redis.call('SET', KEYS[2],
    struct.pack('<ddddddddddd', tokens, carry, ts, ad, dn, cap, rate, 0, -1, 0, 0), 'KEEPTTL')
  return 1
end
local fcap, frate = g1 or 0, g2 or 0
redis.call('SET', KEYS[2],
  struct.pack('<ddddddddddd', tokens, carry, ts, ad, dn, v1, v2, 1, lease_end, fcap, frate),
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
