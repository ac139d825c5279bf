-- set_params.lua: writes a bucket's parameters for quotad's region agent, atomically with the
-- copy of them that token_bucket.lua keeps inside the bucket state.
--
-- KEYS[1]  parameters (hash, no TTL)   qd:v1:{tenant}:<policy>:<version>:p
-- KEYS[2]  token-bucket state (string) qd:v1:{tenant}:<policy>:<version>:b
-- ARGV     'cap', capacity µt, 'rate', µt per second        (token bucket)
--       or 'limit', tokens, 'window', ms                     (sliding window)
--          then optionally the minimum idle TTL in ms ('' or absent: 60000)
-- returns  1
-- errors   'ERR quotad: <what>' for an invalid argument.
--
-- The hash is replaced (DEL + HSET). If the bucket state exists, its parameter copy is
-- rewritten in place (SET ... KEEPTTL), so the decision script never reads KEYS[1] while the
-- bucket lives: cap / rate with src = 1 for token-bucket parameters, src = 0 (back to each
-- call's fallback) otherwise. The expiry is then lengthened if the new parameters need longer
-- to refill the bucket from its stored level (the level only grows with time, so that is an
-- upper bound), and removed if the bucket can no longer refill; it is never shortened.
-- Parameters must be written through this script, never with a bare HSET.

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

if #KEYS ~= 2 or #ARGV < 4 or #ARGV > 5 then
  return err('expected 2 keys and 4 or 5 arguments')
end
local f1, v1, f2, v2 = ARGV[1], int(ARGV[2]), ARGV[3], int(ARGV[4])
local bucket = f1 == 'cap' and f2 == 'rate'
if not (bucket or (f1 == 'limit' and f2 == 'window')) or v1 == nil or v2 == nil then
  return err('expected cap, rate or limit, window with integer values')
end
if bucket and (v1 > MAX_CAP or v2 > MAX_RATE or (v2 > 0 and v1 >= MAX_FILL_RATIO * v2)) then
  return err('capacity and rate must be integers within the bucket bounds')
end
local min_ttl = 60000
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  min_ttl = int(ARGV[5])
  if min_ttl == nil or min_ttl < 1 or min_ttl > MAX_CAP then
    return err('minimum TTL must be an integer number of ms')
  end
end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], f1, v1, f2, v2)

local v = redis.call('GET', KEYS[2])
if not v then
  return 1
end
local tokens, carry, ts, ad, dn, cap, rate, src = struct.unpack('<dddddddd', v)
if not bucket then
  redis.call('SET', KEYS[2], struct.pack('<dddddddd', tokens, carry, ts, ad, dn, cap, rate, 0),
    'KEEPTTL')
  return 1
end
cap, rate = v1, v2
redis.call('SET', KEYS[2], struct.pack('<dddddddd', tokens, carry, ts, ad, dn, cap, rate, 1),
  'KEEPTTL')
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
