-- collect_usage.lua: drains the usage recorded since the last collection, for quotad's region
-- agent. Costs O(buckets taken), never a scan of the keyspace.
--
-- KEYS[1]  activity index (set of state keys; qd:v1:active, or one cluster slot's index)
-- ARGV[1]  how many keys to take at most, integer 1..100000
-- returns  {taken, key, admitted tokens, denied tokens, key, admitted, denied, ...}: taken is
--          how many keys left the index (expired ones included), so a caller knows to go on
-- errors   'ERR quotad: <what>' for an invalid argument.
--
-- Two state layouts: token buckets are one 88-byte string (struct '<ddddddddddd': t, c, ts, ad,
-- dn, then the parameters; see token_bucket.lua), rewritten with ad = dn = 0 (bytes 25..40) and
-- SET ... KEEPTTL; sliding windows are hashes with fields ad / dn.
--
-- SPOP takes each key at most once and the counters are reset in the same atomic step, so usage
-- is never counted twice; a decision after the collection re-lists its key (the decision
-- scripts list a key whenever ad + dn = 0), so none is
-- lost while the key lives. Keys that expired in between are skipped: their usage is lost, which
-- the minimum idle TTL of the decision scripts bounds (collect more often than it). On Redis
-- Cluster the state keys share the index's slot, so touching them here stays within one slot.

local function err(what)
  return redis.error_reply('ERR quotad: ' .. what)
end

if #KEYS ~= 1 or #ARGV ~= 1 then
  return err('expected 1 key and 1 argument')
end
local max = ARGV[1]
if type(max) ~= 'string' or #max > 6 or not string.find(max, '^%d+$') then
  return err('max must be an integer in 1..100000')
end
max = tonumber(max)
if max < 1 or max > 100000 then
  return err('max must be an integer in 1..100000')
end

local keys = redis.call('SPOP', KEYS[1], max)
local out = { #keys }
for _, k in ipairs(keys) do
  local kind = redis.call('TYPE', k)['ok']
  local ad, dn = 0, 0
  if kind == 'string' then
    local v = redis.call('GET', k)
    if #v == 88 then
      ad, dn = struct.unpack('<dd', v, 25)
      if ad + dn > 0 then
        redis.call('SET', k, v:sub(1, 24) .. struct.pack('<dd', 0, 0) .. v:sub(41), 'KEEPTTL')
      end
    end
  elseif kind == 'hash' then
    local v = redis.call('HMGET', k, 'ad', 'dn')
    ad, dn = tonumber(v[1]) or 0, tonumber(v[2]) or 0
    if ad + dn > 0 then
      redis.call('HSET', k, 'ad', 0, 'dn', 0)
    end
  end
  -- A key that expired (or was never decided) has nothing to report and must not be recreated.
  if ad + dn > 0 then
    out[#out + 1] = k
    out[#out + 1] = ad
    out[#out + 1] = dn
  end
end
return out
