-- The floor of any token bucket in Redis: read Redis time, read a key, write it with an expiry.
local t = redis.call('TIME')
local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], t[1], 'PX', 60000)
return 1
