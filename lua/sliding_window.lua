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
-- errors   'ERR quotad: <what>' for every invalid argument, repeated key, key of another type,
--          stored parameter or state out of bounds; nothing is written then (every check
--          comes before the first write). Stored entries and counters are checked as they are
--          read.
--
-- The arithmetic is quota-core/src/window.rs exactly (a differential test holds them equal).
-- Neither representation admits more than the limit in any window of W ms.
-- limit <= 128: an exact log of admitted (ms, cost) entries in field l, 'ms:cost,ms:cost,...',
-- oldest first, one entry per millisecond (same-ms requests are merged, never collide), at most
-- `limit` entries, and their sum in u. A call reads the entries that leave (at the front) and
-- the newest (at the end), never the whole log. A log without u is summed whole once.
-- limit > 128: sub-window counters. W is cut into sub-windows of sub = ceil(W / 128) ms
-- aligned to multiples of sub, and the last n = ceil((W - 1) / sub) + 1 are counted (the most
-- any W ms overlaps): c packs n little-endian doubles, sub-window j at slot j % n; w is the
-- window they were cut for, b the newest sub-window advanced to, s their sum, a the sub-window
-- of the latest admission. A token counts for W to W + 2 * sub - 2 ms (exactly W when W <= 128).
-- Limit changes: hl is the limit the window enforces; a lower limit applies at once, a higher
-- one (hr) only from hu = W after it was first seen (a higher one still restarts the wait), so
-- the tokens another region admitted before giving up the share count before the raise does.
-- Another representation (the limit crossing 128, counters cut for another W, or the
-- two-counter fields ws / cu / pv): every token it still counts is counted as admitted now.
-- Denied requests are not recorded. A clock stepping back is clamped to ts, the latest time seen.
-- Usage fields ad / dn and expiry deadline x as in token_bucket.lua (listed in the index while
-- ad + dn > 0).

-- quotad shared helpers: begin. The same text in every script in lua/ (each script runs on its
-- own, so the block is copied, not included); a test holds the copies equal, the bounds equal to
-- quota-core's bounds.rs, and every call of quotad_helpers to the same arguments.
local UT = 1000000 -- micro-tokens per token
local MAX_CAP = 9007199254740991 -- 2^53 - 1: capacities and refills in µt, times and TTLs in ms
local MAX_PERIOD = 2678400000 -- longest refill period in ms (31 days, below 2^32)
local DEFAULT_PERIOD_MS = 1000 -- period of a refill given per second, and of old states
local MAX_FILL = 9000000000000 -- floor(capacity / refill) * period stays below this
local MAX_COST = 9007199254 -- MAX_CAP / UT: whole tokens per call
local MAX_LIMITS = 16 -- most token buckets one check of several limits decides
local MAX_WINDOW_LIMIT = 1000000000 -- sliding-window limit in tokens
local MAX_WINDOW_MS = 2678400000 -- longest window: 31 days
local MAX_WINDOW_PRODUCT = 2251799813685248 -- 2^51: largest limit * window
local EXACT_LOG_MAX = 128 -- largest sliding-window limit kept as an exact log
local DEFAULT_MIN_TTL_MS = 60000 -- minimum idle TTL when none is given
local DEFAULT_MIN_TTL_ARG = '60000' -- the same as a command argument
local DEFAULT_PERIOD_ARG = '1000' -- DEFAULT_PERIOD_MS as a command argument
local COLLECT_MAX = 100000 -- most keys one usage collection takes
local ONCE_MS = 10000 -- how long a key making a call exactly once lives: past any retry of it
local STATE_LEN = 96 -- bytes of a token-bucket state
local STATE_LEN_NO_PERIOD = 88 -- bytes of a state written without its period (period 1000)
-- Token-bucket state: 12 little-endian doubles (exact for integers below 2^53): tokens (µt),
-- carry (1/per µt), ts (latest ms seen), ad / dn (tokens admitted / denied since the last
-- collection, bytes 25..40), cap, rate, src, until, fcap, frate, per (see token_bucket.lua).
-- A state of the first 11 alone (88 bytes) has per = 1000: rate and frate are µt per second.
local STATE_FMT = '<dddddddddddd'
local STATE_FMT_NO_PERIOD = '<ddddddddddd'
-- Usage counters ad = dn = 0 as they sit in a state (bytes 25..40): two doubles 0.0.
local ZERO_USAGE = '\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0'
local ERR = 'ERR quotad: ' -- prefix of every error reply
-- A decimal integer argument: 1 to 16 digits, no sign, point, exponent, hex or space.
local DIGITS = '^%d+$'
local find = string.find

-- The helpers. Lua creates a closure for every function a script defines, on every call, and
-- one upvalue object for every local a closure captures, so they are made by one call, where a
-- script needs them: quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
-- MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
-- STATE_FMT, STATE_FMT_NO_PERIOD) returns them in a table. The factory captures nothing (the
-- bounds come as arguments), so defining it costs one closure; token_bucket.lua decides its
-- common paths without it. Exactness: every value is an integer below 2^53, so x % y (x >= 0,
-- y >= 1) is exact there, as math.fmod is everywhere.
local function quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
    MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
    STATE_FMT, STATE_FMT_NO_PERIOD)
  local fmod, ceil, find = math.fmod, math.ceil, string.find

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

  -- An optional explicit now in ms ('' or absent: Redis TIME, in whole ms); nil when invalid.
  local function arg_now(s)
    if s == nil or s == '' then
      local t = redis.call('TIME')
      local us = tonumber(t[2])
      return tonumber(t[1]) * 1000 + (us - fmod(us, 1000)) / 1000
    end
    return int(s, MAX_CAP)
  end

  -- An optional integer argument in 1..max ('' or absent: default); nil when invalid.
  local function opt_int(s, default, max)
    if s == nil or s == '' then
      return default
    end
    local n = int(s, max)
    if n == nil or n < 1 then
      return nil
    end
    return n
  end

  -- A reply that is a Redis error (redis.pcall), e.g. WRONGTYPE: the key holds another type.
  local function failed(r)
    return type(r) == 'table' and r.err ~= nil
  end

  -- Token-bucket parameters within the bounds of quota-core BucketParams::per_period: cap µt,
  -- refilling rate µt every per ms. floor(cap / rate) * per is compared with MAX_FILL, below
  -- 2^53, so even a product rounded above 2^53 compares correctly. x % 1 == 0 is false for NaN
  -- and infinities.
  local function bucket_ok(cap, rate, per)
    if cap == nil or rate == nil or per == nil or cap % 1 ~= 0 or rate % 1 ~= 0
        or per % 1 ~= 0 or cap < 0 or cap > MAX_CAP or rate < 0 or rate > MAX_CAP or per < 1
        or per > MAX_PERIOD then
      return false
    end
    return rate == 0 or (cap - fmod(cap, rate)) / rate * per < MAX_FILL
  end

  -- Sliding-window parameters within the bounds of quota-core WindowParams::new (integers).
  local function window_ok(limit, w)
    return limit ~= nil and w ~= nil and limit <= MAX_WINDOW_LIMIT and w >= 1
      and w <= MAX_WINDOW_MS and limit * w <= MAX_WINDOW_PRODUCT
  end

  -- The fields of a token-bucket state, or nil when v is not one (wrong length, NaN, a
  -- fraction or a value out of bounds; without a lease, until = -1 and the floor 0, 0):
  -- tokens, carry, ts, ad, dn, cap, rate, src, until, fcap, frate, per.
  local function state_decode(v)
    local t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per
    if #v == STATE_LEN then
      t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per =
        struct.unpack(STATE_FMT, v)
    elseif #v == STATE_LEN_NO_PERIOD then
      t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate =
        struct.unpack(STATE_FMT_NO_PERIOD, v)
      per = DEFAULT_PERIOD_MS
    else
      return nil
    end
    if t % 1 == 0 and t >= 0 and t <= MAX_CAP and ts % 1 == 0 and ts >= 0 and ts <= MAX_CAP
        and ad % 1 == 0 and ad >= 0 and ad <= MAX_CAP and dn % 1 == 0 and dn >= 0
        and dn <= MAX_CAP and bucket_ok(cap, rate, per) and c % 1 == 0 and c >= 0 and c < per
        and (src == 0 or src == 1)
        and ((lease_end == -1 and fcap == 0 and frate == 0) or (lease_end % 1 == 0
          and lease_end >= 0 and lease_end <= MAX_CAP and bucket_ok(fcap, frate, per))) then
      return t, c, ts, ad, dn, cap, rate, src, lease_end, fcap, frate, per
    end
    return nil
  end

  -- floor((a * b + c) / p) and its remainder for integers a, b, c < p <= MAX_PERIOD (< 2^32),
  -- exact: when a * b + c could pass 2^53, b is split at 2^16 so no product does.
  local function muldiv(a, b, c, p)
    local n = a * b + c
    if n <= MAX_CAP then
      local r = fmod(n, p)
      return (n - r) / p, r
    end
    local bl = fmod(b, 65536)
    local x = a * ((b - bl) / 65536)
    local xr = fmod(x, p)
    local y = xr * 65536 + a * bl + c
    local yr = fmod(y, p)
    return (x - xr) / p * 65536 + (y - yr) / p, yr
  end

  -- Whether e ms from carry c add at least need µt (need > 0) at rate µt per per ms, i.e.
  -- need <= floor((e * rate + c) / per), exact for any e: with e = q * per + e0 and
  -- rate = a * per + b, e * rate + c = (q * rate + e0 * a) * per + (e0 * b + c), and the terms
  -- are taken off need one by one, so a product above 2^53 (inexact) only ever stands for
  -- "more than enough".
  local function enough(e, need, c, rate, per)
    local e0, b = fmod(e, per), fmod(rate, per)
    need = need - (e - e0) / per * rate
    if need <= 0 then
      return true
    end
    need = need - e0 * ((rate - b) / per)
    if need <= 0 then
      return true
    end
    return need <= muldiv(e0, b, c, per)
  end

  -- ceil((need * per - carry) / rate), the ms until need more µt accrue (need > 0, rate > 0):
  -- directly when need * per is exact, else estimated in doubles (off by less than 1 below the
  -- fill bound) and made exact with enough.
  local function time_to(need, carry, rate, per)
    local n = need * per
    if n <= MAX_CAP then
      n = n - carry
      local r = fmod(n, rate)
      if r > 0 then
        return (n - r) / rate + 1
      end
      return n / rate
    end
    local t = ceil((n - carry) / rate)
    if not enough(t, need, carry, rate, per) then
      return t + 1
    end
    if t > 1 and enough(t - 1, need, carry, rate, per) then
      return t - 1
    end
    return t
  end

  -- A bucket's tokens and carry clipped to cap and refilled from ts to now at rate per per ms
  -- (nothing when now <= ts: a clock stepping back), and the latest time seen. The µt added are
  -- floor((e * rate + c) / per), the carry its remainder: directly when e * rate + c is exact,
  -- else split as in enough (the sum stays below cap - tokens there, so every term is exact).
  local function refilled(tokens, carry, ts, cap, rate, per, now)
    if tokens >= cap then
      tokens, carry = cap, 0
    end
    if now <= ts then
      return tokens, carry, ts
    end
    if tokens < cap and rate > 0 then
      local e = now - ts
      local n = e * rate + carry
      if n <= MAX_CAP then
        local r = fmod(n, per)
        local add = (n - r) / per
        if add >= cap - tokens then
          return cap, 0, now
        end
        return tokens + add, r, now
      end
      if enough(e, cap - tokens, carry, rate, per) then
        return cap, 0, now
      end
      local e0, b = fmod(e, per), fmod(rate, per)
      local q, r = muldiv(e0, b, carry, per)
      return tokens + (e - e0) / per * rate + e0 * ((rate - b) / per) + q, r, now
    end
    return tokens, carry, now
  end

  return {
    err = err, int = int, arg_now = arg_now, opt_int = opt_int, failed = failed,
    bucket_ok = bucket_ok, window_ok = window_ok, state_decode = state_decode,
    time_to = time_to, refilled = refilled,
  }
end
-- quotad shared helpers: end.

local h = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS, MAX_WINDOW_LIMIT,
  MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD, STATE_FMT,
  STATE_FMT_NO_PERIOD)
local err, int, arg_now, opt_int, failed, window_ok =
  h.err, h.int, h.arg_now, h.opt_int, h.failed, h.window_ok
local fmod = math.fmod
local fmt, sub, match = string.format, string.sub, string.match

if #KEYS ~= 3 then
  return err('expected 3 keys')
end
if KEYS[1] == KEYS[2] or KEYS[1] == KEYS[3] or KEYS[2] == KEYS[3] then
  return err('the 3 keys must be distinct')
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
  fb_limit = int(ARGV[2], MAX_WINDOW_LIMIT)
  fb_window = int(ARGV[3], MAX_WINDOW_MS)
  if not window_ok(fb_limit, fb_window) then
    return err('fallback limit and window must be integers within the window bounds')
  end
end
local min_ttl = opt_int(ARGV[5], DEFAULT_MIN_TTL_MS, MAX_CAP)
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local now = arg_now(ARGV[4])
if now == nil then
  return err('now must be an integer number of ms')
end

local limit, w
-- pcall: a key of another type is an error reply, not a raised WRONGTYPE.
local p = redis.pcall('HMGET', KEYS[2], 'limit', 'window', 'until', 'flimit', 'fwindow')
if failed(p) then
  return err('the parameters key holds another type')
end
if p[1] or p[2] then
  limit = int(p[1], MAX_WINDOW_LIMIT)
  w = int(p[2], MAX_WINDOW_MS)
  if not window_ok(limit, w) then
    return err('stored parameters are invalid')
  end
  if p[3] or p[4] or p[5] then
    -- A lease end (see set_params.lua): the floor is in force from then on.
    local lease_end = int(p[3], MAX_CAP)
    local fl, fw = int(p[4], MAX_WINDOW_LIMIT), int(p[5], MAX_WINDOW_MS)
    if lease_end == nil or not window_ok(fl, fw) then
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

local st = redis.pcall('HMGET', KEYS[1], 'l', 'u', 'c', 'w', 'b', 's', 'a', 'ws', 'cu', 'pv',
  'hl', 'hr', 'hu', 'ts', 'ad', 'dn', 'x')
if failed(st) then
  return err('the state key holds another type')
end
-- Every stored number is an integer within its bound (a missing field is 0), checked before
-- anything is written.
local function field(i, max)
  local s = st[i]
  if not s then
    return 0
  end
  return int(s, max)
end
local u, cw, cb, cs, ca = field(2, MAX_CAP), field(4, MAX_WINDOW_MS), field(5, MAX_CAP),
  field(6, MAX_CAP), field(7, MAX_CAP)
local ws, cu, pv = field(8, MAX_CAP), field(9, MAX_WINDOW_LIMIT), field(10, MAX_WINDOW_LIMIT)
local hl, hr, hu = field(11, MAX_WINDOW_LIMIT), field(12, MAX_WINDOW_LIMIT), field(13, MAX_CAP)
local seen, ad, dn, x = field(14, MAX_CAP), field(15, MAX_CAP), field(16, MAX_CAP),
  field(17, MAX_CAP)
if not (u and cw and cb and cs and ca and ws and cu and pv and hl and hr and hu and seen and ad
    and dn and x) then
  return err('stored state is invalid')
end
if seen > now then
  now = seen
end

-- The sub-window length and count of a window of wl ms: ceil(wl / 128) (128 is quota-core
-- window::SUB_WINDOWS) and ceil((wl - 1) / sub) + 1.
local function geometry(wl)
  local sw = (wl + 127 - fmod(wl + 127, 128)) / 128
  local r = fmod(wl - 1, sw)
  local n = (wl - 1 - r) / sw + 1
  if r > 0 then
    n = n + 1
  end
  return sw, n
end

local counts = st[3]
local cn
if counts then
  if cw < 1 then
    return err('stored state is invalid')
  end
  local _
  _, cn = geometry(cw)
  if #counts ~= 8 * cn or ca > cb then
    return err('stored state is invalid')
  end
end
local bad = false
-- Counter slot k (0-based), checked.
local function slot(k)
  local v = struct.unpack('<d', counts, 8 * k + 1)
  if not (v % 1 == 0 and v >= 0 and v <= MAX_CAP) then
    bad = true
    return 0
  end
  return v
end
local function set_slot(k, v)
  counts = sub(counts, 1, 8 * k) .. struct.pack('<d', v) .. sub(counts, 8 * k + 9)
end
-- What the counters still count at now.
local function counted()
  if not counts or cs == 0 then
    return 0
  end
  local sw, n = geometry(cw)
  local i = (now - fmod(now, sw)) / sw
  local last = cb + n
  if i < last then
    last = i
  end
  local left = cs
  for j = cb + 1, last do
    left = left - slot(fmod(j, n))
  end
  if left < 0 then
    bad = true
  end
  return left
end

-- Limit changes: a cut applies at once, a raise after it has stood a window.
local lim = limit
if st[11] and limit > hl then
  if hu == 0 or limit > hr then
    hu = now + w
  elseif now >= hu then
    hl, hr, hu = limit, 0, 0
  end
  if hu > 0 then
    hr, lim = limit, hl
  end
else
  hl, hr, hu = limit, 0, 0
end

-- Tokens another representation still counts, counted again as admitted now.
local moved = 0
if now < ws + 2 * w then
  moved = cu + pv
end

local out = { 'HSET', KEYS[1], 'ts', fmt('%d', now) }
local drop = { 'HDEL', KEYS[1] }
local allowed, retry, remaining, reset
-- The wait until cost fits (cost <= limit): at the limit in force, or at the raised one once
-- it applies. free_in(k): the wait until k counted tokens have left.
local function wait(free_in, used)
  local a, b
  if cost <= lim then
    a = free_in(used + cost - lim)
  end
  if lim < limit and hu > 0 then
    b = free_in(used + cost - limit)
    if hu - now > b then
      b = hu - now
    end
  end
  if a == nil or (b ~= nil and b < a) then
    return b
  end
  return a
end

if limit <= EXACT_LOG_MAX then
  moved = moved + counted()
  local log = st[1] or ''
  local used = u
  if log ~= '' and not st[2] then
    -- No sum stored: the log is read whole, once.
    local chars = 0
    used = 0
    for a, b in string.gmatch(log, '(%d+):(%d+)') do
      local t, c = int(a, now), int(b, MAX_COST)
      if t == nil or c == nil or c < 1 then
        return err('stored state is invalid')
      end
      chars = chars + #a + #b + 2
      used = used + c
    end
    if chars - 1 ~= #log or string.find(log, '[^%d:,]') or used > MAX_CAP then
      return err('stored state is invalid')
    end
  end
  -- The entries that have left the window, at the front.
  local pos = 1
  while pos <= #log do
    local a, b, e = match(log, '^(%d+):(%d+)()', pos)
    local t, c = int(a, now), int(b, MAX_COST)
    if t == nil or c == nil or c < 1 or c > used or (e <= #log and sub(log, e, e) ~= ',') then
      return err('stored state is invalid')
    end
    if t + w > now then
      break
    end
    used = used - c
    pos = e + 1
  end
  if pos > #log then
    if used ~= 0 then
      return err('stored state is invalid')
    end
    log = ''
  elseif pos > 1 then
    log = sub(log, pos)
  end
  -- The newest entry: where it starts, its ms and cost.
  local function newest()
    local cut = string.find(log, ',[^,]*$', math.max(1, #log - 28))
    local from = cut and cut + 1 or 1
    local a, b = match(log, '^(%d+):(%d+)$', from)
    local t, c = int(a, now), int(b, MAX_COST)
    if t == nil or c == nil then
      bad = true
      return from, 0, 0
    end
    return from, t, c
  end
  local function append(c)
    if log == '' then
      log = fmt('%d:%d', now, c)
    else
      local from, t, lc = newest()
      if t == now then
        log = sub(log, 1, from - 1) .. fmt('%d:%d', now, lc + c)
      else
        log = log .. ',' .. fmt('%d:%d', now, c)
      end
    end
    used = used + c
  end
  if moved > 0 then
    append(moved)
  end
  if cost == 0 then
    allowed, retry = 1, 0
  elseif cost <= lim and used + cost <= lim then
    allowed, retry = 1, 0
    append(cost)
  elseif cost > limit then
    allowed, retry = 0, -1
  else
    allowed = 0
    retry = wait(function(need)
      if need <= 0 then
        return 0
      end
      local q, freed = 1, 0
      while q <= #log do
        local a, b, e = match(log, '^(%d+):(%d+)()', q)
        local t, c = int(a, now), int(b, MAX_COST)
        if t == nil or c == nil then
          bad = true
          return 0
        end
        freed = freed + c
        if freed >= need then
          return t + w - now
        end
        q = e + 1
      end
      return 0
    end, used)
  end
  remaining = lim - used
  if remaining < 0 then
    remaining = 0
  end
  reset = 0
  if log ~= '' then
    local _, t = newest()
    reset = t + w - now
  end
  if bad then
    return err('stored state is invalid')
  end
  if log ~= (st[1] or '') or used ~= u or (log ~= '' and not st[2]) then
    out[#out + 1], out[#out + 2] = 'l', log
    out[#out + 1], out[#out + 2] = 'u', fmt('%d', used)
  end
  if counts then
    drop[#drop + 1], drop[#drop + 2], drop[#drop + 3], drop[#drop + 4], drop[#drop + 5] =
      'c', 'w', 'b', 's', 'a'
  end
else
  local log = st[1]
  if log and log ~= '' then
    -- An exact log: what it counts.
    local chars = 0
    for a, b in string.gmatch(log, '(%d+):(%d+)') do
      local t, c = int(a, now), int(b, MAX_COST)
      if t == nil or c == nil or c < 1 then
        return err('stored state is invalid')
      end
      chars = chars + #a + #b + 2
      if t + w > now then
        moved = moved + c
      end
    end
    if chars - 1 ~= #log or string.find(log, '[^%d:,]') then
      return err('stored state is invalid')
    end
  end
  if counts and cw ~= w then
    moved = moved + counted()
    counts = nil
  end
  local sw, n = geometry(w)
  local i = (now - fmod(now, sw)) / sw
  if not counts then
    counts, cw, cb, cs, ca = string.rep('\0', 8 * n), w, i, 0, 0
  end
  -- Advance to sub-window i: the sub-windows that leave the count are emptied.
  if i > cb then
    if i - cb >= n then
      for j = cb + 1, cb + n do
        cs = cs - slot(fmod(j, n))
      end
      counts = string.rep('\0', 8 * n)
    else
      for j = cb + 1, i do
        local k = fmod(j, n)
        local v = slot(k)
        if v > 0 then
          cs = cs - v
          set_slot(k, 0)
        end
      end
    end
    cb = i
  end
  if cs < 0 then
    bad = true
  end
  local cur = fmod(i, n)
  local add = moved
  if moved > 0 then
    cs, ca = cs + moved, i
  end
  if cost == 0 then
    allowed, retry = 1, 0
  elseif cost <= lim and cs + cost <= lim then
    allowed, retry = 1, 0
    add = add + cost
    cs, ca = cs + cost, i
  elseif cost > limit then
    allowed, retry = 0, -1
  else
    allowed = 0
    retry = wait(function(need)
      if need <= 0 then
        return 0
      end
      -- The moved tokens are in cs already; their slot is written below.
      local v = { struct.unpack('<' .. string.rep('d', n), counts) }
      v[cur + 1] = v[cur + 1] + add
      local from = i - n + 1
      if from < 0 then
        from = 0
      end
      local freed = 0
      for j = from, i do
        freed = freed + v[fmod(j, n) + 1]
        if freed >= need then
          return (j + n) * sw - now
        end
      end
      return 0
    end, cs)
  end
  if add > 0 then
    set_slot(cur, slot(cur) + add)
  end
  if bad then
    return err('stored state is invalid')
  end
  remaining = lim - cs
  if remaining < 0 then
    remaining = 0
  end
  reset = 0
  if cs > 0 then
    reset = (ca + n) * sw - now
  end
  out[#out + 1], out[#out + 2] = 'c', counts
  out[#out + 1], out[#out + 2] = 'w', fmt('%d', cw)
  out[#out + 1], out[#out + 2] = 'b', fmt('%d', cb)
  out[#out + 1], out[#out + 2] = 's', fmt('%d', cs)
  out[#out + 1], out[#out + 2] = 'a', fmt('%d', ca)
  if st[1] then
    drop[#drop + 1], drop[#drop + 2] = 'l', 'u'
  end
end

if cost == 0 then
  return { 1, remaining, 0, reset }
end
if st[8] or st[9] or st[10] then
  drop[#drop + 1], drop[#drop + 2], drop[#drop + 3] = 'ws', 'cu', 'pv'
end
if not st[11] or hl ~= tonumber(st[11]) then
  out[#out + 1], out[#out + 2] = 'hl', fmt('%d', hl)
end
if hr ~= field(12, MAX_WINDOW_LIMIT) or hu ~= field(13, MAX_CAP) then
  out[#out + 1], out[#out + 2] = 'hr', fmt('%d', hr)
  out[#out + 1], out[#out + 2] = 'hu', fmt('%d', hu)
end
-- Writes, last: the index (the only write that can fail), then the state.
if ad + dn == 0 and failed(redis.pcall('SADD', KEYS[3], KEYS[1])) then
  return err('the activity index holds another type')
end
if allowed == 1 then
  out[#out + 1], out[#out + 2] = 'ad', fmt('%d', math.min(ad + cost, MAX_CAP))
else
  out[#out + 1], out[#out + 2] = 'dn', fmt('%d', math.min(dn + cost, MAX_CAP))
end
-- Expiry: once the window is empty and no raise is pending the key is not needed (a missing
-- window is an empty one).
local ttl = reset
if hu - now > ttl then
  ttl = hu - now
end
if ttl < min_ttl then
  ttl = min_ttl
end
local set_ttl
if st[17] == nil or now + ttl > x then
  set_ttl = ttl + (ttl - fmod(ttl, 4)) / 4
  out[#out + 1], out[#out + 2] = 'x', fmt('%d', now + set_ttl)
end
if #drop > 2 then
  redis.call(unpack(drop))
end
redis.call(unpack(out))
if set_ttl then
  redis.call('PEXPIRE', KEYS[1], fmt('%d', set_ttl))
end
return { allowed, remaining, retry, reset }
