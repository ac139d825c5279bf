-- set_params.lua: writes a bucket's parameters for quotad's region agent, atomically with the
-- copy of them that token_bucket.lua keeps inside the bucket state.
--
-- KEYS[1]  parameters (hash, no TTL)   qd:v1:{tenant}:<policy>:<version>:p
-- KEYS[2]  token-bucket state (string) qd:v1:{tenant}:<policy>:<version>:b
-- KEYS[3]  optional: the token-bucket state of the version this one replaces (a changed policy),
--          qd:v1:{tenant}:<policy>:<old version>:b; for sliding-window parameters with a
--          replaced version, the old window state qd:v1:{tenant}:<policy>:<old version>:w,
--          and then KEYS[4] the old parameters (…:<old version>:p) and KEYS[5] this version's
--          window state (…:<version>:w)
-- ARGV[1..4]  'cap', capacity µt, 'rate', µt per period    (token bucket)
--          or 'limit', tokens, 'window', ms                  (sliding window)
--          or 'slots', slots 0..1000000, '', ''              (concurrency limit; 2 keys only)
-- ARGV[5]  optional minimum idle TTL in ms ('' or absent: 60000)
-- ARGV[6]  optional lease: ms from now the parameters hold ('' or absent: no end)
-- ARGV[7], ARGV[8]  with a lease: the floor in force after it, of the same kind as ARGV[1..4]
--          (capacity and rate, limit and window, or slots and '')
-- ARGV[9]  optional explicit now in ms since the epoch ('' or absent: Redis TIME)
-- ARGV[10] optional token-bucket refill period in ms, 1..2678400000, of the parameters and the
--          floor alike ('' or absent: 1000, rate per second); '' for a sliding window
-- ARGV[11] optional, with a lease: the latest lease end in ms since the epoch on this server's
--          clock ('' or absent: none); until = min(now + lease, this), so a call that runs
--          late (queued, or Redis stalled after it was sent) still ends the lease no later
--          than the region's own lease end, which the caller mapped onto this clock
-- ARGV[12], ARGV[13] optional, together: the writer's fence and the allocation epoch it
--          writes ('' or absent: none). Stored with the parameters (fence, ep); a write with
--          a fence below the stored one (an agent deposed since), an epoch below the stored
--          one (an older allocation landing late), or none where one is stored is refused
--          with 'ERR quotad: fenced: …' and changes nothing
-- returns  1
-- errors   'ERR quotad: <what>' for an invalid argument (token-bucket pairs within the bucket
--          bounds, sliding-window pairs within the window bounds sliding_window.lua applies),
--          repeated keys, a key of another type or an invalid stored state; every check comes
--          before the first write, so nothing is written then.
--
-- The hash is replaced (DEL + HSET): cap, rate, per [, until, fcap, frate] or limit, window
-- [, until, flimit, fwindow] [, hlimit, huntil] or slots [, until, fslots], then [, fence, ep],
-- until = min(now + lease, ARGV[11]) in this server's clock. The decision scripts enforce
-- the floor from until on by themselves: the region agent renews until once half of it has
-- passed, so a region whose daemon died falls back to its floor when its stored lease ends
-- (at the latest when its lease does) even while gateways keep calling this Redis directly.
--
-- A concurrency limit's slots (hold.lua) keep no copy of the parameters: hold.lua reads them
-- on every acquisition, the floor from until on, while the holders keep the slots they have.
-- Its live slots are not carried to a new version (a changed policy starts with none in
-- flight).
--
-- If the token-bucket state exists, its parameter copy is rewritten in place (SET ... KEEPTTL),
-- so the decision script never reads KEYS[1] while the bucket lives: src = 1 for token-bucket
-- parameters, src = 0 (back to each call's fallback) otherwise. A state written with another
-- period loses its carry (less than 1 µt; see token_bucket.lua); an 88-byte state is read with
-- period 1000 and rewritten in the 96-byte layout. The expiry is then lengthened
-- if the parameters in force now need longer to refill the bucket from its stored level (the
-- level only grows with time, so that is an upper bound), and removed if the bucket can no
-- longer refill (or not within MAX_WAIT, from a deep debt); it is never shortened. Parameters must be written through this script, never
-- with a bare HSET.
--
-- A changed policy (KEYS[3], token-bucket parameters): what the old bucket had spent stays
-- spent. Both buckets refilled to now under the parameters in force for each, the new level is
-- max(floor, new level - (old capacity - old level)), the new level being the capacity when
-- the new bucket has no state yet, and floor 0, or the old level when that is a debt (a debt
-- is kept, never deepened by a smaller capacity), and at least new capacity - MAX_CAP (see
-- token_bucket.lua, Debt). This applies while the new state does not exist or is still on the
-- fallback (src = 0: decided before its parameters were written), so a repeated call never
-- takes the tokens twice; a missing old state is a full bucket (nothing spent). The old state
-- is left as it is (its usage is still collected; the daemon clears it afterwards).
--
-- A changed sliding-window policy (KEYS[3..5], window parameters): when the new window has no
-- state yet and the old one has stored parameters, what the old window still counts stays
-- counted (quota-core window::carry_over). Both exact logs: the old entries both windows
-- cover, as they are; otherwise the tokens the old window counts now (limit - remaining of a
-- peek, at most its limit; sub-window counters add all they count) are recorded as admitted
-- now, as one log entry or as a two-counter state (ws, cu) that sliding_window.lua converts.
-- The new state expires as sliding_window.lua would set it.

-- A held raise (sliding windows): when the highest limit written (the limit, or a floor above
-- it) is above the limit in force now of the parameters replaced (this key's, else KEYS[4]'s
-- when a policy changed), hlimit = that old limit (the lower hlimit while a hold runs, whose
-- wait restarts) and huntil = now + the longer window, at most 2^53 - 1: sliding_window.lua
-- enforces at most hlimit until huntil with or without a window state, so the tokens the
-- region giving up the share admitted leave first. A limit at or below hlimit cancels a hold,
-- any other keeps it (huntil passed included: it dates the raise). Replaced window parameters
-- that are malformed (fields out of bounds, a hold without its pair) count as limit 0: the
-- new limit is held at 0 for a window, never over-admitted, and the parameters are repaired.
-- quota-core window::held_raise computes the same.

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

local h = quotad_helpers(MAX_CAP, MAX_PERIOD, MAX_FILL, DEFAULT_PERIOD_MS, MAX_WINDOW_LIMIT,
  MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, STATE_LEN, STATE_LEN_NO_PERIOD, STATE_FMT,
  STATE_FMT_NO_PERIOD, MAX_WAIT)
local err, int, arg_now, opt_int, failed = h.err, h.int, h.arg_now, h.opt_int, h.failed
local bucket_ok, window_ok, state_decode, time_to, refilled =
  h.bucket_ok, h.window_ok, h.state_decode, h.time_to, h.refilled
local fmod = math.fmod

if (#KEYS < 2 or #KEYS > 5 or #KEYS == 4) or #ARGV < 4 or #ARGV > 13 then
  return err('expected 2, 3 or 5 keys and 4 to 13 arguments')
end
for i = 1, #KEYS do
  for j = i + 1, #KEYS do
    if KEYS[i] == KEYS[j] then
      return err('the keys must be distinct')
    end
  end
end
local f1, v1, f2, v2 = ARGV[1], int(ARGV[2], MAX_CAP), ARGV[3], int(ARGV[4], MAX_CAP)
local bucket = f1 == 'cap' and f2 == 'rate'
-- A concurrency limit: 'slots', limit, '', ''.
local slots = f1 == 'slots' and f2 == '' and ARGV[4] == ''
if slots then
  v2 = 0
end
if not (bucket or slots or (f1 == 'limit' and f2 == 'window')) or v1 == nil or v2 == nil then
  return err('expected cap, rate or limit, window or slots with integer values')
end
if #KEYS == 5 and bucket then
  return err('5 keys are for sliding-window parameters')
end
if #KEYS > 2 and slots then
  return err('a concurrency limit takes 2 keys: it carries nothing over')
end
local per = DEFAULT_PERIOD_MS
if bucket then
  per = opt_int(ARGV[10], DEFAULT_PERIOD_MS, MAX_PERIOD)
  if per == nil then
    return err('the period must be an integer number of ms in 1..' .. MAX_PERIOD)
  end
elseif ARGV[10] ~= nil and ARGV[10] ~= '' then
  return err('a period is for token-bucket parameters only')
end
-- The pair as the decision script would accept it.
local function pair_ok(a, b)
  if bucket then
    return bucket_ok(a, b, per)
  elseif slots then
    return a <= MAX_SLOTS and b == 0
  end
  return window_ok(a, b)
end
if not pair_ok(v1, v2) then
  if bucket then
    return err('capacity, refill and period must be integers within the bucket bounds')
  elseif slots then
    return err('a concurrency limit must be an integer in 0..' .. MAX_SLOTS)
  end
  return err('limit and window must be integers within the window bounds')
end
local min_ttl = opt_int(ARGV[5], DEFAULT_MIN_TTL_MS, MAX_CAP)
if min_ttl == nil then
  return err('minimum TTL must be an integer number of ms in 1..' .. MAX_CAP)
end
local lease, g1, g2
if ARGV[6] ~= nil and ARGV[6] ~= '' then
  lease, g1, g2 = int(ARGV[6], MAX_CAP), int(ARGV[7], MAX_CAP), int(ARGV[8], MAX_CAP)
  if slots then
    g2 = ARGV[8] == '' and 0 or nil
  end
  if lease == nil or g1 == nil or g2 == nil then
    return err('a lease needs integer ms and an integer floor pair')
  end
  if not pair_ok(g1, g2) then
    return err('the floor must be integers within the same bounds as the parameters')
  end
elseif (ARGV[7] ~= nil and ARGV[7] ~= '') or (ARGV[8] ~= nil and ARGV[8] ~= '') then
  return err('a floor needs a lease')
end
local not_after
if ARGV[11] ~= nil and ARGV[11] ~= '' then
  not_after = int(ARGV[11], MAX_CAP)
  if not_after == nil then
    return err('the latest lease end must be an integer number of ms')
  end
  if not lease then
    return err('a latest lease end needs a lease')
  end
end
local fence, ep
if (ARGV[12] ~= nil and ARGV[12] ~= '') or (ARGV[13] ~= nil and ARGV[13] ~= '') then
  fence, ep = int(ARGV[12], MAX_CAP), int(ARGV[13], MAX_CAP)
  if fence == nil or ep == nil then
    return err('a fence and an epoch must both be integers')
  end
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
  if not_after and not_after < lease_end then
    lease_end = not_after
  end
end

-- Both keys' types and the stored state are checked before the first write.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  return err('the parameters key holds another type')
end
-- The fence: a deposed agent, or a write of an older allocation that lands late, never
-- replaces what a later one wrote.
if kind == 'hash' then
  local stored = redis.call('HMGET', KEYS[1], 'fence', 'ep')
  if stored[1] then
    local sf, se = tonumber(stored[1]), tonumber(stored[2]) or 0
    if not fence then
      return err('fenced: written by an agent with fence ' .. stored[1] .. '; this write has none')
    end
    if fence < sf then
      return err('fenced: fence ' .. fence .. ' is below the stored ' .. stored[1])
    end
    if ep < se then
      return err('fenced: epoch ' .. ep .. ' is below the stored ' .. se)
    end
  end
end
local fenced = {}
if fence then
  fenced = { 'fence', string.format('%d', fence), 'ep', string.format('%d', ep) }
end
local v = redis.pcall('GET', KEYS[2])
if failed(v) then
  return err('the state key holds another type')
end
local tokens, carry, ts, ad, dn, cap, rate, src0, _, cper
if v then
  tokens, carry, ts, ad, dn, cap, rate, src0, _, _, _, cper = state_decode(v)
  if tokens == nil then
    return err('stored state is invalid')
  end
end
-- What the replaced bucket had spent by now (nil: nothing to carry over), and its level when
-- that is a debt (else 0).
local spent, owed = nil, 0
if KEYS[3] and bucket and (not v or src0 == 0) then
  local o = redis.pcall('GET', KEYS[3])
  if failed(o) then
    return err('the replaced state key holds another type')
  end
  if o then
    local t, c, ots, _, _, ocap, orate, osrc, ountil, ofcap, ofrate, oper = state_decode(o)
    if t == nil then
      return err('the replaced state is invalid')
    end
    if osrc == 1 and ountil >= 0 and now >= ountil then
      ocap, orate = ofcap, ofrate
    end
    t = refilled(t, c, ots, ocap, orate, oper, now)
    spent = ocap - t
    if t < 0 then
      owed = t
    end
  end
end

-- A changed sliding window: the fields of the new window state that keep what the old window
-- counts (nil: nothing to write), read and checked here, written after the parameters.
local wstate
if KEYS[5] then
  local nk = redis.call('TYPE', KEYS[5])['ok']
  if nk ~= 'hash' and nk ~= 'none' then
    return err('the window state key holds another type')
  end
  local op = redis.pcall('HMGET', KEYS[4], 'limit', 'window', 'until', 'flimit', 'fwindow')
  if failed(op) then
    return err('the replaced parameters key holds another type')
  end
  local oh = redis.pcall('HMGET', KEYS[3], 'l', 'ws', 'cu', 'pv', 'ts', 'c')
  if failed(oh) then
    return err('the replaced window state key holds another type')
  end
  if nk == 'none' and (op[1] or op[2]) and (oh[1] or oh[2] or oh[3] or oh[4] or oh[5]) then
    local ol, ow = int(op[1], MAX_WINDOW_LIMIT), int(op[2], MAX_WINDOW_MS)
    if not window_ok(ol, ow) then
      return err('the replaced parameters are invalid')
    end
    if op[3] or op[4] or op[5] then
      local oend = int(op[3], MAX_CAP)
      local fl, fw = int(op[4], MAX_WINDOW_LIMIT), int(op[5], MAX_WINDOW_MS)
      if oend == nil or not window_ok(fl, fw) then
        return err('the replaced parameters are invalid')
      end
      if now >= oend then
        ol, ow = fl, fw
      end
    end
    local function ofield(i, max)
      if not oh[i] then
        return 0
      end
      return int(oh[i], max)
    end
    local ows, ocu, opv = ofield(2, MAX_CAP), ofield(3, MAX_WINDOW_LIMIT), ofield(4, MAX_WINDOW_LIMIT)
    local ots = ofield(5, MAX_CAP)
    if not (ows and ocu and opv and ots) then
      return err('the replaced window state is invalid')
    end
    local t = now
    if ots > t then
      t = ots
    end
    -- The old log's entries, checked as sliding_window.lua checks them.
    local log = oh[1] or ''
    local ts_list, cost_list, chars = {}, {}, 0
    for a, b in string.gmatch(log, '(%d+):(%d+)') do
      local et, ec = int(a, t), int(b, MAX_COST)
      if et == nil or ec == nil or ec < 1 then
        return err('the replaced window state is invalid')
      end
      chars = chars + #a + #b + 2
      ts_list[#ts_list + 1], cost_list[#cost_list + 1] = et, ec
    end
    if (log ~= '' and chars - 1 ~= #log) or find(log, '[^%d:,]') then
      return err('the replaced window state is invalid')
    end
    -- Sub-window counters (sliding_window.lua): what they still count at t.
    local counted = 0
    local oc = oh[6]
    if oc then
      if #oc < 32 then
        return err('the replaced window state is invalid')
      end
      local cw, cb, cs = struct.unpack('<ddd', oc)
      if not (cw % 1 + cb % 1 + cs % 1 == 0 and cw >= 1 and cw <= MAX_WINDOW_MS and cb >= 0
          and cb <= MAX_CAP and cs >= 0 and cs <= MAX_CAP) then
        return err('the replaced window state is invalid')
      end
      local sw = (cw + 127 - fmod(cw + 127, 128)) / 128
      local r = fmod(cw - 1, sw)
      local n = (cw - 1 - r) / sw + 1
      if r > 0 then
        n = n + 1
      end
      if #oc ~= 32 + 8 * n then
        return err('the replaced window state is invalid')
      end
      local i = (t - fmod(t, sw)) / sw
      counted = cs
      for j = cb + 1, math.min(i, cb + n) do
        counted = counted - struct.unpack('<d', oc, 33 + 8 * fmod(j, n))
      end
      if not (counted % 1 == 0 and counted >= 0) then
        return err('the replaced window state is invalid')
      end
    end
    local nl, nw = v1, v2
    if lease and now >= lease_end then
      nl, nw = g1, g2
    end
    local entries, used = {}, 0
    if ol <= EXACT_LOG_MAX then
      for i = 1, #ts_list do
        if ts_list[i] + ow > t then
          used = used + cost_list[i]
          if nl <= EXACT_LOG_MAX and ts_list[i] + nw > t then
            entries[#entries + 1] = string.format('%d:%d', ts_list[i], cost_list[i])
          end
        end
      end
      if used > ol then
        used = ol
      end
    else
      local start = t - fmod(t, ow)
      if ows + ow == start then
        opv, ocu = ocu, 0
      elseif ows ~= start then
        opv, ocu = 0, 0
      end
      local est, cap = opv * (ow - (t - start)) + ocu * ow, ol * ow
      local free = 0
      if cap > est then
        free = cap - est
      end
      used = ol - (free - fmod(free, ow)) / ow
    end
    used = used + counted
    local reset = 0
    if ol <= EXACT_LOG_MAX and nl <= EXACT_LOG_MAX then
      if counted > 0 then
        entries[#entries + 1] = string.format('%d:%d', t, counted)
      end
      if #entries > 0 then
        local last = ts_list[1]
        for i = 1, #ts_list do
          if ts_list[i] + ow > t and ts_list[i] + nw > t then
            last = ts_list[i]
          end
        end
        if counted > 0 then
          last = t
        end
        wstate = { 'l', table.concat(entries, ',') }
        reset = last + nw - t
      end
    elseif used > 0 then
      if nl <= EXACT_LOG_MAX then
        wstate = { 'l', string.format('%d:%d', t, used) }
        reset = nw
      else
        local start = t - fmod(t, nw)
        wstate = { 'ws', string.format('%d', start), 'cu', string.format('%d', used), 'pv', '0' }
        reset = (nw - (t - start)) + nw
      end
    end
    if wstate then
      if reset < min_ttl then
        reset = min_ttl
      end
      local set_ttl = reset + (reset - fmod(reset, 4)) / 4
      wstate.ttl = set_ttl
      wstate[#wstate + 1], wstate[#wstate + 2] = 'ts', string.format('%d', t)
      wstate[#wstate + 1], wstate[#wstate + 2] = 'x', string.format('%d', t + set_ttl)
    end
  end
end

-- A raise of a sliding window: the hold written with the parameters (read before any write).
local hold = {}
if not bucket and not slots then
  -- The limit in force now of the window parameters at k, and their hold; nil: none stored;
  -- 0 (no hold): malformed.
  local function in_force(k)
    local o = redis.pcall('HMGET', k, 'limit', 'window', 'until', 'flimit', 'fwindow', 'hlimit',
      'huntil')
    if failed(o) or not (o[1] or o[2] or o[6] or o[7]) then
      return nil
    end
    local l, w = int(o[1], MAX_WINDOW_LIMIT), int(o[2], MAX_WINDOW_MS)
    if not window_ok(l, w) then
      return 0
    end
    if o[3] or o[4] or o[5] then
      local e, fl, fw = int(o[3], MAX_CAP), int(o[4], MAX_WINDOW_LIMIT), int(o[5], MAX_WINDOW_MS)
      if e == nil or not window_ok(fl, fw) then
        return 0
      end
      if now >= e then
        l = fl
      end
    end
    if o[6] or o[7] then
      local hl, hu = int(o[6], MAX_WINDOW_LIMIT), int(o[7], MAX_CAP)
      if hl == nil or hu == nil then
        return 0
      end
      return l, hl, hu
    end
    return l
  end
  local ol, ohl, ohu = in_force(KEYS[1])
  if ol == nil and KEYS[4] then
    ol, ohl, ohu = in_force(KEYS[4])
  end
  if ol then
    local top, hw = v1, v2
    if lease then
      top, hw = math.max(top, g1), math.max(hw, g2)
    end
    if top > ol then
      local held = ol
      if ohu and now < ohu and ohl < held then
        held = ohl
      end
      hold = { 'hlimit', string.format('%d', held), 'huntil',
        string.format('%d', math.min(now + hw, MAX_CAP)) }
    elseif ohl and top > ohl then
      hold = { 'hlimit', string.format('%d', ohl), 'huntil', string.format('%d', ohu) }
    end
  end
end

redis.call('DEL', KEYS[1])
if bucket then
  if lease then
    redis.call('HSET', KEYS[1], f1, v1, f2, v2, 'per', per, 'until', lease_end, 'fcap', g1,
      'frate', g2, unpack(fenced))
  else
    redis.call('HSET', KEYS[1], f1, v1, f2, v2, 'per', per, unpack(fenced))
  end
elseif slots then
  if lease then
    redis.call('HSET', KEYS[1], 'slots', v1, 'until', lease_end, 'fslots', g1, unpack(fenced))
  else
    redis.call('HSET', KEYS[1], 'slots', v1, unpack(fenced))
  end
else
  for _, x in ipairs(fenced) do
    hold[#hold + 1] = x
  end
  if lease then
    redis.call('HSET', KEYS[1], f1, v1, f2, v2, 'until', lease_end, 'flimit', g1, 'fwindow',
      g2, unpack(hold))
  else
    redis.call('HSET', KEYS[1], f1, v1, f2, v2, unpack(hold))
  end
end

if wstate then
  redis.call('HSET', KEYS[5], unpack(wstate))
  redis.call('PEXPIRE', KEYS[5], string.format('%d', wstate.ttl))
end

-- The parameters in force now.
local icap, irate = v1, v2
if lease and now >= lease_end then
  icap, irate = g1, g2
end
if spent and spent > 0 and (v or icap > 0 or owed < 0) then
  if v then
    if cper ~= per then
      carry = 0
    end
    cper = per
    tokens, carry, ts = refilled(tokens, carry, ts, icap, irate, per, now)
  else
    -- A new bucket is full, less what was spent (a bucket of capacity 0 needs no state, but
    -- for a debt).
    tokens, carry, ts, ad, dn, cper = icap, 0, now, 0, 0, per
    v = true
  end
  tokens = tokens - spent
  if tokens < owed then
    tokens = owed
  end
  if tokens < icap - MAX_CAP then
    tokens = icap - MAX_CAP
  end
end
if not v then
  return 1
end
if not bucket then
  redis.call('SET', KEYS[2],
    struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, cap, rate, 0, -1, 0, 0, cper), 'KEEPTTL')
  return 1
end
if cper ~= per then
  carry = 0 -- counted in another period's units: less than 1 µt, dropped
end
local fcap, frate = g1 or 0, g2 or 0
redis.call('SET', KEYS[2],
  struct.pack(STATE_FMT, tokens, carry, ts, ad, dn, v1, v2, 1, lease_end, fcap, frate, per),
  'KEEPTTL')
cap, rate = icap, irate
if tokens >= cap then
  return 1
end
if rate == 0 then
  redis.call('PERSIST', KEYS[2])
  return 1
end
-- From the level the next refill starts at (a debt clipped as token_bucket.lua clips it).
if tokens < cap - MAX_CAP then
  tokens = cap - MAX_CAP
end
local need = time_to(cap - tokens, carry, rate, per)
if need == -1 then
  -- Full only beyond MAX_WAIT: the key must stay.
  redis.call('PERSIST', KEYS[2])
  return 1
end
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
