-- Shaped like the seed articles' token bucket: HMGET, refill in floats, HSET, EXPIRE, float
-- arguments (capacity, tokens per second, now in seconds, cost). No usage counters, no
-- validation, no retry-after or reset.
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local capacity = tonumber(ARGV[1])
local refill = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local tokens = tonumber(bucket[1]) or capacity
local last_ts = tonumber(bucket[2]) or now
local elapsed = math.max(0, now - last_ts)
tokens = math.min(capacity, tokens + elapsed * refill)
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / refill) * 2)
return allowed
