-- The floor of lua/token_bucket.lua's contract, with its keys and arguments: Redis TIME, GET of
-- the 96-byte state (unpacked), on a missing key HGETALL of the parameters and SADD to the
-- activity index, SET PX of a packed state, its reply (5 fields with a batch argument); no
-- argument or state checks and no refill arithmetic.
local t = redis.call('TIME')
local now = t[1] * 1000
local v = redis.call('GET', KEYS[1])
local tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per =
  0, 0, now, 0, 0, 0, 0, 0, -1, 0, 0, 1000
if v then
  tokens, carry, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per =
    struct.unpack('<dddddddddddd', v)
else
  redis.call('HGETALL', KEYS[2])
  redis.call('SADD', KEYS[3], KEYS[1])
end
redis.call('SET', KEYS[1], struct.pack('<dddddddddddd', tokens, carry, now, ad + 1, dn, cap,
  rate, src, lease_end, fcap, frate, per), 'PX', '60000')
if #ARGV == 7 then
  return { 1, 0, 0, 0, 1 }
end
return { 1, 0, 0, 0 }
