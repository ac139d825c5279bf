-- sliding_window.lua: one atomic "at most N in any W" decision for quotad.
--
-- KEYS[1]  window state (hash, expires when empty)  qd:v1:{tenant}:<policy>:<version>:w
-- KEYS[2]  window parameters (hash, no TTL)         qd:v1:{tenant}:<policy>:<version>:p
--          fields: limit (tokens), window (ms), and with a lease end: until (ms, this
--          server's clock), flimit / fwindow (the floor, in force from until on)
-- KEYS[3]  activity index (set of state keys decided since the last usage collection)
-- ARGV[1]  cost in whole tokens, integer 0..9007199254; 0 is a peek: the window's state now,
--          nothing written, nothing counted (returns allowed 1, retry 0)
-- ARGV[2]  fallback limit, used when KEYS[2] holds no parameters ('' = none)
-- ARGV[3]  fallback window in ms ('' = none; given together with ARGV[2])
-- ARGV[4]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- ARGV[5]  optional minimum idle TTL in ms, integer 1..2^53-1 ('' or absent: 60000); keeps the
--          usage counters of an idle window until the next collection
-- returns  {allowed 0|1, remaining tokens, retry_after_ms (-1 = never: cost above the limit),
--           reset_ms (ms until the window is empty)}
-- errors   'ERR quotad: <what>' for every invalid argument or stored parameter.
--
-- The arithmetic is quota-core/src/window.rs exactly (a differential test holds them equal).
-- limit <= 128: an exact log of admitted (ms, cost) entries in field l, 'ms:cost,ms:cost,...',
-- oldest first, one entry per millisecond (same-ms requests are merged, never collide), at most
-- `limit` entries. limit > 128: two fixed-window counters (ws start, cu current, pv previous),
-- the previous weighted by its overlap with the sliding window: an approximation.
-- Denied requests are not recorded. A clock stepping back is clamped to ts, the latest time seen.
-- Usage fields ad / dn and expiry deadline x as in token_bucket.lua (listed in the index while
-- ad + dn > 0).

local MAX_CAP = 9007199254740991
local MAX_COST = 9007199254
local MAX_LIMIT = 1000000000
local MAX_WINDOW = 604800000
local MAX_PRODUCT = 2251799813685248 -- 2^51
local EXACT_LOG_MAX = 128
local DEFAULT_MIN_TTL_MS = 60000

local fmod = math.fmod
local find = string.find
local fmt = string.format

local function err(what)
  return redis.error_reply('ERR quotad: ' .. what)
end

local function int(s, max)
  if type(s) ~= 'string' or #s == 0 or #s > 16 or not find(s, '^%d+$') then
    return nil
  end
  local n = tonumber(s)
  if n > max then
    return nil
  end
  return n
end

local function params_ok(limit, window)
  return limit ~= nil and window ~= nil and window >= 1 and limit * window <= MAX_PRODUCT
end

if #KEYS ~= 3 then
  return err('expected 3 keys')
end
if #ARGV < 3 or #ARGV > 5 then
  return err('expected 3 to 5 arguments')
end
local cost = int(ARGV[1], MAX_COST)
if cost == nil then
  return err('cost must be an integer in 0..' .. MAX_COST)
end
local fb_limit, fb_window
if ARGV[2] ~= '' or ARGV[3] ~= '' then
  fb_limit = int(ARGV[2], MAX_LIMIT)
  fb_window = int(ARGV[3], MAX_WINDOW)
  if not params_ok(fb_limit, fb_window) then
    return err('fallback limit and window must be integers within the window bounds')
  end
end
local now
if ARGV[4] == nil or ARGV[4] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + (t[2] - fmod(t[2], 1000)) / 1000
else
  now = int(ARGV[4], MAX_CAP)
  if now == nil then
    return err('now must be an integer number of ms')
  end
end

local min_ttl = DEFAULT_MIN_TTL_MS
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  min_ttl = int(ARGV[5], MAX_CAP)
  if min_ttl == nil or min_ttl < 1 then
    return err('minimum TTL must be an integer number of ms in 1..9007199254740991')
  end
end

local limit, w
local p = redis.call('HMGET', KEYS[2], 'limit', 'window', 'until', 'flimit', 'fwindow')
if p[1] or p[2] then
  limit = int(p[1], MAX_LIMIT)
  w = int(p[2], MAX_WINDOW)
  if not params_ok(limit, w) then
    return err('stored parameters are invalid')
  end
  if p[3] or p[4] or p[5] then
    -- A lease end (see set_params.lua): the floor is in force from then on.
    local lease_end, fl, fw = int(p[3], MAX_CAP), int(p[4], MAX_LIMIT), int(p[5], MAX_WINDOW)
    if lease_end == nil or not params_ok(fl, fw) then
      return err('stored parameters are invalid')
    end
    if now >= lease_end then
      limit, w = fl, fw
    end
  end
elseif fb_limit then
  limit, w = fb_limit, fb_window
else
  return err('no parameters stored and no fallback given')
end

local h = redis.call('HMGET', KEYS[1], 'l', 'ws', 'cu', 'pv', 'ts', 'ad', 'dn', 'x')
local seen = tonumber(h[5])
if seen and seen > now then
  now = seen
end
local ws, cu, pv = tonumber(h[2]) or 0, tonumber(h[3]) or 0, tonumber(h[4]) or 0
local out = { 'HSET', KEYS[1], 'ts', fmt('%d', now) }

local allowed, retry, remaining, reset
if limit <= EXACT_LOG_MAX then
  local ts_list, cost_list, used = {}, {}, 0
  for t, c in string.gmatch(h[1] or '', '(%d+):(%d+)') do
    t = tonumber(t)
    if t + w > now then
      ts_list[#ts_list + 1] = t
      cost_list[#cost_list + 1] = tonumber(c)
      used = used + cost_list[#cost_list]
    end
  end
  local n = #ts_list
  if cost == 0 then
    allowed, retry = 1, 0
  elseif cost <= limit and used + cost <= limit then
    allowed, retry = 1, 0
    if n > 0 and ts_list[n] == now then
      cost_list[n] = cost_list[n] + cost
    else
      n = n + 1
      ts_list[n], cost_list[n] = now, cost
    end
    used = used + cost
  elseif cost > limit then
    allowed, retry = 0, -1
  else
    allowed = 0
    local need, freed = used + cost - limit, 0
    for i = 1, n do
      freed = freed + cost_list[i]
      if freed >= need then
        retry = ts_list[i] + w - now
        break
      end
    end
  end
  remaining = limit - used
  if remaining < 0 then
    remaining = 0
  end
  reset = 0
  local parts = {}
  for i = 1, n do
    parts[i] = fmt('%d:%d', ts_list[i], cost_list[i])
  end
  if n > 0 then
    reset = ts_list[n] + w - now
  end
  out[#out + 1], out[#out + 2] = 'l', table.concat(parts, ',')
  if ws ~= 0 or cu ~= 0 or pv ~= 0 then
    out[#out + 1], out[#out + 2] = 'ws', '0'
    out[#out + 1], out[#out + 2] = 'cu', '0'
    out[#out + 1], out[#out + 2] = 'pv', '0'
  end
else
  local start = now - fmod(now, w)
  if ws + w == start then
    pv, cu = cu, 0
  elseif ws ~= start then
    pv, cu = 0, 0
  end
  ws = start
  local off = now - start
  local cap = limit * w
  if cost == 0 then
    allowed, retry = 1, 0
  elseif cost <= limit and pv * (w - off) + (cu + cost) * w <= cap then
    allowed, retry = 1, 0
    cu = cu + cost
  elseif cost > limit then
    allowed, retry = 0, -1
  elseif cu + cost <= limit then
    local k = (limit - cu - cost) * w
    allowed, retry = 0, w - (k - fmod(k, pv)) / pv - off
  else
    local k = (limit - cost) * w
    local fade = w - (k - fmod(k, cu)) / cu
    if fade < 0 then
      fade = 0
    end
    allowed, retry = 0, (w - off) + fade
  end
  local est = pv * (w - off) + cu * w
  remaining = 0
  if cap > est then
    local free = cap - est
    remaining = (free - fmod(free, w)) / w
  end
  if cu > 0 then
    reset = (w - off) + w
  elseif pv > 0 then
    reset = w - off
  else
    reset = 0
  end
  out[#out + 1], out[#out + 2] = 'ws', fmt('%d', ws)
  out[#out + 1], out[#out + 2] = 'cu', fmt('%d', cu)
  out[#out + 1], out[#out + 2] = 'pv', fmt('%d', pv)
  if h[1] and h[1] ~= '' then
    out[#out + 1], out[#out + 2] = 'l', ''
  end
end

if cost == 0 then
  return { 1, remaining, 0, reset }
end
local ad, dn = tonumber(h[6]) or 0, tonumber(h[7]) or 0
if ad + dn == 0 then
  redis.call('SADD', KEYS[3], KEYS[1])
end
if allowed == 1 then
  out[#out + 1], out[#out + 2] = 'ad', ad + cost
else
  out[#out + 1], out[#out + 2] = 'dn', dn + cost
end
-- Expiry: once the window is empty the key is not needed (a missing window is an empty one).
local ttl = reset
if ttl < min_ttl then
  ttl = min_ttl
end
local x = tonumber(h[8])
local set_ttl
if x == nil or now + ttl > x then
  set_ttl = ttl + (ttl - fmod(ttl, 4)) / 4
  out[#out + 1], out[#out + 2] = 'x', fmt('%d', now + set_ttl)
end
redis.call(unpack(out))
if set_ttl then
  redis.call('PEXPIRE', KEYS[1], fmt('%d', set_ttl))
end
return { allowed, remaining, retry, reset }
