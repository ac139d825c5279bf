-- sliding_window.lua: one atomic "at most N in any W" decision for quotad.
--
-- KEYS[1]  window state (hash, expires when empty)  qd:v1:{tenant}:<policy>:<version>:w
-- KEYS[2]  window parameters (hash, no TTL)         qd:v1:{tenant}:<policy>:<version>:p
--          fields: limit (tokens), window (ms), and with a lease end: until (ms, this
--          server's clock), flimit / fwindow (the floor, in force from until on); with a held
--          raise (set_params.lua): hlimit (tokens), huntil (ms, this server's clock)
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
-- limit > 128: sub-window counters in field c. W is cut into sub-windows of sub = ceil(W / 128)
-- ms aligned to multiples of sub, and the last n = ceil((W - 1) / sub) + 1 are counted (the
-- most any W ms overlaps): c packs little-endian doubles, the window W they were cut for, the
-- newest sub-window advanced to, their sum, the sub-window of the latest admission, then n
-- counts (sub-window j at slot j % n). A token counts for W to W + 2 * sub - 2 ms (exactly W
-- when W <= 128).
-- Limit changes: a lower limit applies at once, a higher one only once it has stood a window,
-- so the tokens another region admitted before giving up the share count before the raise
-- does. The parameters' hlimit / huntil (set_params.lua writes them with a raise) hold the
-- limit at most hlimit until huntil, with or without a state, and date the raise: a state
-- that enforced a lower limit takes it at huntil. The state's field h: the limit the window
-- enforces, or 'limit:raise:at' while a raise is pending, for limits that change without
-- a hold in the parameters (a fallback, a floor above the limit, parameters without hlimit):
-- those apply from `at` = W after they were first seen (a higher one restarts the wait).
-- The lower of the two limits applies.
-- Another representation (the limit crossing 128, counters cut for another W, or the
-- two-counter fields ws / cu / pv of a state without h): every token it still counts is
-- counted as admitted now.
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
local MAX_WAIT = 2251799813685248 -- 2^51: longest wait reported in ms; longer reads as never
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
local MAX_HOLD_TTL = 3600000 -- longest a hold lives unsettled, in ms (1 h)
local HOLD_MEMORY_MS = 600000 -- how long a hold's record is kept after the hold ended
local MAX_HOLD_ID = 64 -- longest hold id, in characters
local MAX_SLOTS = 1000000 -- largest concurrency limit, in slots
local STATE_LEN = 96 -- bytes of a token-bucket state
local STATE_LEN_NO_PERIOD = 88 -- bytes of a state written without its period (period 1000)
-- Token-bucket state: 12 little-endian doubles (exact for integers below 2^53): tokens (µt;
-- negative in debt, down to -MAX_CAP), carry (1/per µt), ts (latest ms seen), ad / dn (tokens
-- admitted / denied since the last collection, bytes 25..40), cap, rate, src, until, fcap,
-- frate, per (see token_bucket.lua).
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
-- STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT) returns them in a table. The factory captures
-- nothing (the bounds come as arguments), so defining it costs one closure; token_bucket.lua
-- decides its common paths without it. Exactness: every value is an integer below 2^53, so
-- x % y (x >= 0, y >= 1) is exact there, as math.fmod is everywhere.
local function quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
    MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
    STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
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
  -- tokens (negative in debt), carry, ts, ad, dn, cap, rate, src, until, fcap, frate, per.
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
    if t % 1 == 0 and t >= -MAX_CAP and t <= MAX_CAP and ts % 1 == 0 and ts >= 0 and ts <= MAX_CAP
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

  -- ceil((need * per - carry) / rate), the ms until need more µt accrue (0 < need <= MAX_CAP,
  -- rate > 0), or -1 when that is beyond MAX_WAIT (only a deep debt at a slow refill comes
  -- near): directly when need * per is exact, else estimated in doubles (three roundings, off
  -- by less than 1 up to MAX_WAIT + 3, so an estimate above MAX_WAIT + 2 is beyond it) and
  -- made exact with enough.
  local function time_to(need, carry, rate, per)
    local n = need * per
    local t
    if n <= MAX_CAP then
      n = n - carry
      local r = fmod(n, rate)
      t = (n - r) / rate
      if r > 0 then
        t = t + 1
      end
    else
      t = ceil((n - carry) / rate)
      if t > MAX_WAIT + 2 then
        return -1
      end
      if not enough(t, need, carry, rate, per) then
        t = t + 1
      elseif t > 1 and enough(t - 1, need, carry, rate, per) then
        t = t - 1
      end
    end
    if t > MAX_WAIT then
      return -1
    end
    return t
  end

  -- A bucket's tokens (its level: negative in debt) and carry clipped to cap, and to
  -- cap - MAX_CAP below (a debt deeper than these parameters keep exact: cap - tokens must stay
  -- below 2^53), and refilled from ts to now at rate per per ms (nothing when now <= ts: a
  -- clock stepping back), and the latest time seen. The µt added are floor((e * rate + c) /
  -- per), the carry its remainder: directly when e * rate + c is exact, else split as in
  -- enough (the sum stays below cap - tokens there, so every term is exact).
  local function refilled(tokens, carry, ts, cap, rate, per, now)
    if tokens >= cap then
      tokens, carry = cap, 0
    elseif tokens < cap - MAX_CAP then
      tokens = cap - MAX_CAP
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

-- Arguments, inline as token_bucket.lua checks them (find(s, DIGITS), then s + 0): the common
-- paths create no closure and never make the helpers.
local keys, argv = KEYS, ARGV
local k1, k2, k3 = keys[1], keys[2], keys[3]
local fmt, sub, match, byte, fmod = string.format, string.sub, string.match, string.byte,
  math.fmod
if #keys ~= 3 then
  return redis.error_reply(ERR .. 'expected 3 keys')
end
if k1 == k2 or k1 == k3 or k2 == k3 then
  return redis.error_reply(ERR .. 'the 3 keys must be distinct')
end
local n_args = #argv
if n_args < 3 or n_args > 5 then
  return redis.error_reply(ERR .. 'expected 3 to 5 arguments')
end
local s = argv[1]
local cost = 1
if s ~= '1' then
  cost = #s <= 16 and find(s, DIGITS) and s + 0
  if not cost or cost > MAX_COST then
    return redis.error_reply(ERR .. 'cost must be an integer in 0..' .. MAX_COST)
  end
end
local fb_limit, fb_window
local a, b = argv[2], argv[3]
if a ~= '' or b ~= '' then
  fb_limit = #a <= 16 and find(a, DIGITS) and a + 0
  fb_window = #b <= 16 and find(b, DIGITS) and b + 0
  if not (fb_limit and fb_window and fb_limit <= MAX_WINDOW_LIMIT and fb_window >= 1
      and fb_window <= MAX_WINDOW_MS and fb_limit * fb_window <= MAX_WINDOW_PRODUCT) then
    return redis.error_reply(ERR
      .. 'fallback limit and window must be integers within the window bounds')
  end
end
local min_ttl = DEFAULT_MIN_TTL_MS
s = argv[5]
if s and s ~= '' and s ~= DEFAULT_MIN_TTL_ARG then
  min_ttl = #s <= 16 and find(s, DIGITS) and s + 0
  if not min_ttl or min_ttl < 1 or min_ttl > MAX_CAP then
    return redis.error_reply(ERR .. 'minimum TTL must be an integer number of ms in 1..'
      .. MAX_CAP)
  end
end
local now
s = argv[4]
if s and s ~= '' then
  now = #s <= 16 and find(s, DIGITS) and s + 0
  if not now or now > MAX_CAP then
    return redis.error_reply(ERR .. 'now must be an integer number of ms')
  end
else
  local t = redis.call('TIME')
  local us = t[2] + 0
  now = t[1] * 1000 + (us - us % 1000) / 1000
end

-- Parameters: the stored ones (HGETALL: at most the seven fields set_params.lua writes), else
-- the fallback. pcall: a key of another type is an error reply, not a raised WRONGTYPE.
local limit, w, ph, pu
local p = redis.pcall('HGETALL', k2)
if p.err then
  return redis.error_reply(ERR .. 'the parameters key holds another type')
end
local n_p = #p
if n_p > 0 then
  local pl, pw, pe, pfl, pfw, phl, phu
  for i = 1, n_p, 2 do
    local name = p[i]
    if name == 'limit' then
      pl = p[i + 1]
    elseif name == 'window' then
      pw = p[i + 1]
    elseif name == 'until' then
      pe = p[i + 1]
    elseif name == 'flimit' then
      pfl = p[i + 1]
    elseif name == 'fwindow' then
      pfw = p[i + 1]
    elseif name == 'hlimit' then
      phl = p[i + 1]
    elseif name == 'huntil' then
      phu = p[i + 1]
    end
  end
  if phl or phu then
    -- A held raise: both fields, within the bounds, with the window's own fields.
    ph = phl and #phl <= 16 and find(phl, DIGITS) and phl + 0
    pu = phu and #phu <= 16 and find(phu, DIGITS) and phu + 0
    if not (ph and pu and ph <= MAX_WINDOW_LIMIT and pu <= MAX_CAP and (pl or pw)) then
      return redis.error_reply(ERR .. 'stored parameters are invalid')
    end
  end
  if pl or pw then
    limit = pl and #pl <= 16 and find(pl, DIGITS) and pl + 0
    w = pw and #pw <= 16 and find(pw, DIGITS) and pw + 0
    if not (limit and w and limit <= MAX_WINDOW_LIMIT and w >= 1 and w <= MAX_WINDOW_MS
        and limit * w <= MAX_WINDOW_PRODUCT) then
      return redis.error_reply(ERR .. 'stored parameters are invalid')
    end
    if pe or pfl or pfw then
      -- A lease end (see set_params.lua): the floor is in force from then on.
      local lease_end = pe and #pe <= 16 and find(pe, DIGITS) and pe + 0
      local fl = pfl and #pfl <= 16 and find(pfl, DIGITS) and pfl + 0
      local fw = pfw and #pfw <= 16 and find(pfw, DIGITS) and pfw + 0
      if not (lease_end and lease_end <= MAX_CAP and fl and fw and fl <= MAX_WINDOW_LIMIT
          and fw >= 1 and fw <= MAX_WINDOW_MS and fl * fw <= MAX_WINDOW_PRODUCT) then
        return redis.error_reply(ERR .. 'stored parameters are invalid')
      end
      if now >= lease_end then
        limit, w = fl, fw
      end
    end
  end
end
if not limit then
  if not fb_limit then
    return redis.error_reply(ERR .. 'no parameters stored and no fallback given')
  end
  limit, w = fb_limit, fb_window
end

-- The state. Every stored number is an integer within its bound (a missing field is 0),
-- checked before anything is written.
local st = redis.pcall('HMGET', k1, 'l', 'u', 'c', 'h', 'ts', 'ad', 'dn', 'x')
if st.err then
  return redis.error_reply(ERR .. 'the state key holds another type')
end
local log, su, counts, sh, sts, sx = st[1] or '', st[2], st[3], st[4], st[5], st[8]
local u, seen, ad, dn, x = 0, 0, 0, 0, 0
if su then
  u = #su <= 16 and find(su, DIGITS) and su + 0
end
if sts then
  seen = #sts <= 16 and find(sts, DIGITS) and sts + 0
end
s = st[6]
if s then
  ad = #s <= 16 and find(s, DIGITS) and s + 0
end
s = st[7]
if s then
  dn = #s <= 16 and find(s, DIGITS) and s + 0
end
if sx then
  x = #sx <= 16 and find(sx, DIGITS) and sx + 0
end
if not (u and seen and ad and dn and x and u <= MAX_CAP and seen <= MAX_CAP and ad <= MAX_CAP
    and dn <= MAX_CAP and x <= MAX_CAP) then
  return redis.error_reply(ERR .. 'stored state is invalid')
end
if seen > now then
  now = seen
end
-- h: the limit the window enforces, and with a raise pending 'limit:raise:at'.
local hl, hr, hu = -1, 0, 0
if sh then
  if #sh <= 10 and find(sh, DIGITS) then
    hl = sh + 0
  else
    local c1, c2, c3 = match(sh, '^(%d+):(%d+):(%d+)$')
    hl = c1 and #c1 <= 10 and c1 + 0
    hr = c2 and #c2 <= 10 and c2 + 0
    hu = c3 and #c3 <= 16 and c3 + 0
    if not (hl and hr and hu and hu >= 1 and hr > hl) then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
  end
  if hl > MAX_WINDOW_LIMIT or hr > MAX_WINDOW_LIMIT or hu > MAX_CAP then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
end
-- A state without h (the two-counter layout, or written by set_params.lua): what its counters
-- ws / cu / pv may still count (all of both, until two windows after ws) is counted as
-- admitted now.
local moved, legacy = 0, false
if sts and not sh then
  local o = redis.call('HMGET', k1, 'ws', 'cu', 'pv')
  if o[1] or o[2] or o[3] then
    legacy = true
    local hp = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS,
      MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD,
      STATE_FMT, STATE_FMT_NO_PERIOD, MAX_WAIT)
    local ws, cu, pv = hp.int(o[1] or '0', MAX_CAP), hp.int(o[2] or '0', MAX_WINDOW_LIMIT),
      hp.int(o[3] or '0', MAX_WINDOW_LIMIT)
    if not (ws and cu and pv) then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
    if now < ws + 2 * w then
      moved = cu + pv
    end
  end
end

-- Limit changes: a cut applies at once, a raise once it has stood a window (the parameters'
-- hold dates it when they have one); ra: when limit applies if it does not yet (0: it does).
local lim, ra = limit, 0
if hl >= 0 and limit > hl then
  if hu == 0 or limit > hr then
    hu = pu or now + w
  end
  if now >= hu then
    hl, hr, hu = limit, 0, 0
  else
    hr, lim, ra = limit, hl, hu
  end
else
  hl, hr, hu = limit, 0, 0
end
if ph and now < pu and ph < limit then
  if ph < lim then
    lim = ph
  end
  if pu > ra then
    ra = pu
  end
end

-- Sub-window counters c: the little-endian doubles window, newest sub-window, sum, sub-window
-- of the latest admission, then n counts (sub-window j at slot j % n).
local cw, cb, cs, ca, csub, cn
if counts then
  if #counts < 32 then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  cw, cb, cs, ca = struct.unpack('<dddd', counts)
  if not (cw % 1 + cb % 1 + cs % 1 + ca % 1 == 0 and cw >= 1 and cw <= MAX_WINDOW_MS
      and cb >= 0 and cb <= MAX_CAP and cs >= 0 and cs <= MAX_CAP and ca >= 0 and ca <= cb) then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  -- ceil(cw / 128) (128: quota-core window::SUB_WINDOWS) and ceil((cw - 1) / sub) + 1.
  csub = (cw + 127 - (cw + 127) % 128) / 128
  local r = (cw - 1) % csub
  cn = (cw - 1 - r) / csub + 1
  if r > 0 then
    cn = cn + 1
  end
  if #counts ~= 32 + 8 * cn then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
end
local bad = false

local out = { 'HSET', k1, 'ts', fmt('%d', now) }
local drop
local allowed, retry, remaining, reset
if limit <= EXACT_LOG_MAX then
  if counts and cs > 0 then
    -- Counters: what they still count, counted as admitted now.
    local i = (now - now % csub) / csub
    local last = cb + cn
    if i < last then
      last = i
    end
    local left = cs
    for j = cb + 1, last do
      local v = struct.unpack('<d', counts, 33 + 8 * (j % cn))
      if not (v % 1 == 0 and v >= 0) then
        bad = true
      end
      left = left - v
    end
    if bad or left < 0 then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
    moved = moved + left
  end
  local n_log = #log
  local used = u
  if n_log > 0 and not su then
    -- No sum stored (a log set_params.lua wrote, or one kept without u): read whole, once.
    local chars = 0
    used = 0
    for e1, e2 in string.gmatch(log, '(%d+):(%d+)') do
      local t = #e1 <= 16 and e1 + 0
      local c = #e2 <= 16 and e2 + 0
      if not (t and c and t <= now and c >= 1 and c <= MAX_COST) then
        return redis.error_reply(ERR .. 'stored state is invalid')
      end
      chars = chars + #e1 + #e2 + 2
      used = used + c
    end
    if chars - 1 ~= n_log or find(log, '[^%d:,]') or used > MAX_CAP then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
  end
  -- The entries that have left the window, at the front.
  local pos = 1
  while pos <= n_log do
    local e1, e2, e = match(log, '^(%d+):(%d+)()', pos)
    local t = e1 and #e1 <= 16 and e1 + 0
    local c = e2 and #e2 <= 16 and e2 + 0
    if not (t and c and t <= now and c >= 1 and c <= used
        and (e > n_log or byte(log, e) == 44)) then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
    if t + w > now then
      break
    end
    used = used - c
    pos = e + 1
  end
  if pos > n_log then
    if used ~= 0 then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
    log = ''
  elseif pos > 1 then
    log = sub(log, pos)
  end
  -- The newest entry: where it starts, its ms and cost (entries are at most 27 characters).
  local from, newest, newest_c = 1, -1, 0
  n_log = #log
  if n_log > 0 then
    local cut = find(log, ',[^,]*$', n_log > 28 and n_log - 28 or 1)
    if cut then
      from = cut + 1
    end
    local e1, e2 = match(log, '^(%d+):(%d+)$', from)
    newest = e1 and #e1 <= 16 and e1 + 0
    newest_c = e2 and #e2 <= 16 and e2 + 0
    if not (newest and newest_c and newest <= now) then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
  end
  -- Appended (merged into the newest entry when it is of this ms): what moved, and the cost.
  local add = moved
  if cost > 0 and cost <= lim and used + moved + cost <= lim then
    allowed, retry = 1, 0
    add = add + cost
  elseif cost == 0 then
    allowed, retry = 1, 0
  elseif cost > limit then
    allowed, retry = 0, -1
  else
    allowed = 0
  end
  if add > 0 then
    if newest == now then
      log = sub(log, 1, from - 1) .. fmt('%d:%d', now, newest_c + add)
    elseif n_log > 0 then
      log = log .. fmt(',%d:%d', now, add)
      from = n_log + 2
    else
      log = fmt('%d:%d', now, add)
    end
    newest = now
    used = used + add
  end
  if not retry then
    -- The wait until need counted tokens have left: the entry where they add up.
    local function free_in(need)
      local q, freed = 1, 0
      while need > 0 and q <= #log do
        local e1, e2, e = match(log, '^(%d+):(%d+)()', q)
        local t, c = e1 and e1 + 0, e2 and e2 + 0
        if not (t and c) then
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
    end
    if cost <= lim then
      retry = free_in(used + cost - lim)
    end
    if lim < limit and ra > 0 then
      local r = free_in(used + cost - limit)
      if ra - now > r then
        r = ra - now
      end
      if not retry or r < retry then
        retry = r
      end
    end
  end
  remaining = lim - used
  if remaining < 0 then
    remaining = 0
  end
  reset = 0
  if newest >= 0 and log ~= '' then
    reset = newest + w - now
  end
  if bad then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  if log ~= (st[1] or '') or used ~= u or not su then
    out[5], out[6], out[7], out[8] = 'l', log, 'u', fmt('%d', used)
  end
  if counts then
    drop = 'c'
  end
else
  if log ~= '' then
    -- An exact log: what it counts.
    local chars = 0
    for e1, e2 in string.gmatch(log, '(%d+):(%d+)') do
      local t = #e1 <= 16 and e1 + 0
      local c = #e2 <= 16 and e2 + 0
      if not (t and c and t <= now and c >= 1 and c <= MAX_COST) then
        return redis.error_reply(ERR .. 'stored state is invalid')
      end
      chars = chars + #e1 + #e2 + 2
      if t + w > now then
        moved = moved + c
      end
    end
    if chars - 1 ~= #log or find(log, '[^%d:,]') then
      return redis.error_reply(ERR .. 'stored state is invalid')
    end
  end
  -- Slot k of the counters (0-based, after the 32-byte header), checked.
  local function slot(k)
    local v = struct.unpack('<d', counts, 33 + 8 * k)
    if not (v % 1 == 0 and v >= 0 and v <= MAX_CAP) then
      bad = true
      return 0
    end
    return v
  end
  if counts and cw ~= w then
    -- Counters cut for another window: what they still count, counted as admitted now.
    local i = (now - now % csub) / csub
    local last = cb + cn
    if i < last then
      last = i
    end
    local left = cs
    for j = cb + 1, last do
      left = left - slot(j % cn)
    end
    if left < 0 then
      bad = true
    end
    moved = moved + left
    counts = nil
  end
  local sw = (w + 127 - (w + 127) % 128) / 128
  local r = (w - 1) % sw
  local n = (w - 1 - r) / sw + 1
  if r > 0 then
    n = n + 1
  end
  local i = (now - now % sw) / sw
  local cur = i % n
  local fresh = not counts
  if fresh then
    counts, cw, cb, cs, ca = string.rep('\0', 32 + 8 * n), w, i, 0, 0
  end
  -- Advance to sub-window i: the sub-windows that leave the count (cb + 1 .. i, at most n of
  -- them) are emptied; the slots keep their values until the one write below.
  local first = cb + 1
  if i - cb > n then
    first = i - n + 1
  end
  for j = first, i do
    cs = cs - slot(j % n)
  end
  local advanced = i > cb
  if bad or cs < 0 then
    return redis.error_reply(ERR .. 'stored state is invalid')
  end
  -- What slot cur holds now: emptied if advanced to it.
  local cur_v = 0
  if not advanced then
    cur_v = slot(cur)
  end
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
    local from = i - n + 1
    if from < 0 then
      from = 0
    end
    -- The wait until need counted tokens have left: the sub-window, oldest first, where they
    -- add up (the slots of cb + 1 .. i - 1 still hold sub-windows that have left; slot cur
    -- holds cur_v and what moved).
    local function free_in(need)
      local freed = 0
      if need <= 0 then
        return 0
      end
      for j = from, i do
        local k = j % n
        if j == i then
          freed = freed + cur_v + add
        elseif j <= cb then
          freed = freed + struct.unpack('<d', counts, 33 + 8 * k)
        end
        if freed >= need then
          return (j + n) * sw - now
        end
      end
      return 0
    end
    if cost <= lim then
      retry = free_in(cs + cost - lim)
    end
    if lim < limit and ra > 0 then
      local rr = free_in(cs + cost - limit)
      if ra - now > rr then
        rr = ra - now
      end
      if not retry or rr < retry then
        retry = rr
      end
    end
  end
  remaining = lim - cs
  if remaining < 0 then
    remaining = 0
  end
  reset = 0
  if cs > 0 then
    reset = (ca + n) * sw - now
  end
  if advanced or add > 0 or fresh then
    -- One new string: the header, the slots before the emptied run, zeros, slot cur, the rest.
    local head = struct.pack('<dddd', w, i, cs, ca)
    local v = struct.pack('<d', cur_v + add)
    local o = 32 + 8 * cur -- bytes before slot cur
    if not advanced then
      counts = head .. sub(counts, 33, o) .. v .. sub(counts, o + 9)
    elseif i - cb >= n then
      counts = head .. string.rep('\0', 8 * cur) .. v .. string.rep('\0', 8 * (n - cur - 1))
    else
      local s0 = (cb + 1) % n -- the first emptied slot; the run ends at cur
      if s0 <= cur then
        counts = head .. sub(counts, 33, 32 + 8 * s0) .. string.rep('\0', 8 * (cur - s0)) .. v
          .. sub(counts, o + 9)
      else
        counts = head .. string.rep('\0', 8 * cur) .. v .. sub(counts, o + 9, 32 + 8 * s0)
          .. string.rep('\0', 8 * (n - s0))
      end
    end
    out[5], out[6] = 'c', counts
  end
  if st[1] or su then
    drop = 'l'
  end
end

if cost == 0 then
  return { 1, remaining, 0, reset }
end
-- Writes, last: the index (the only write that can fail), then the state.
if ad + dn == 0 and type(redis.pcall('SADD', k3, k1)) == 'table' then
  return redis.error_reply(ERR .. 'the activity index holds another type')
end
local hold
if hu > 0 then
  hold = fmt('%d:%d:%d', hl, hr, hu)
else
  hold = fmt('%d', hl)
end
if hold ~= sh then
  out[#out + 1], out[#out + 2] = 'h', hold
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
if not sx or now + ttl > x then
  set_ttl = ttl + (ttl - ttl % 4) / 4
  out[#out + 1], out[#out + 2] = 'x', fmt('%d', now + set_ttl)
end
if drop == 'c' then
  redis.call('HDEL', k1, 'c')
elseif drop == 'l' then
  redis.call('HDEL', k1, 'l', 'u')
end
if legacy then
  redis.call('HDEL', k1, 'ws', 'cu', 'pv')
end
redis.call(unpack(out))
if set_ttl then
  redis.call('PEXPIRE', k1, fmt('%d', set_ttl))
end
return { allowed, remaining, retry, reset }
