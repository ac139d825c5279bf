//! The Lua scripts share one block (bounds, the token-bucket state layout, and the helpers: the
//! error reply, integer validation, `TIME` to ms, state decoding, the exact refill and waits,
//! made by one factory, `quotad_helpers`), copied into each script because gateways run every
//! script on its own. This test fails when a copy drifts, when a bound in Lua differs from
//! quota-core's, when a script defines a bound or a helper of its own outside the block, or when
//! a script calls the factory with other arguments than it takes (they are positional).
//!
//! `token_bucket.lua` alone does the common work of those helpers inline (so a decision creates
//! no closure) and calls the factory only on its rare paths; the differential, fuzz and
//! bad-input tests hold its decisions, states and error replies to the references.

use quota_core::bounds::{
    DEFAULT_PERIOD_MS, EXACT_LOG_MAX, HOLD_MEMORY_MS, MAX_BURST, MAX_CAPACITY_UT,
    MAX_FILL_BOUND_MS, MAX_HOLD_ID_LEN, MAX_HOLD_TTL_MS, MAX_LIMITS_PER_CHECK, MAX_PERIOD_MS,
    MAX_REFILL_UT, MAX_WAIT_MS, MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT, ONCE_KEY_MS,
    UT,
};
use quota_store::script::{
    CHARGE_LUA, COLLECT_BATCH_MAX, COLLECT_USAGE_LUA, HOLD_LUA, REFUND_LUA, SETTLE_LUA,
    SET_PARAMS_LUA, SLIDING_WINDOW_LUA, TOKEN_BUCKETS_LUA, TOKEN_BUCKET_LUA,
};
use quota_store::{DEFAULT_MIN_IDLE_TTL_MS, MAX_COST};

const BEGIN: &str = "-- quotad shared helpers: begin.";
const END: &str = "-- quotad shared helpers: end.";

const SCRIPTS: [(&str, &str); 9] = [
    ("token_bucket.lua", TOKEN_BUCKET_LUA),
    ("token_buckets.lua", TOKEN_BUCKETS_LUA),
    ("sliding_window.lua", SLIDING_WINDOW_LUA),
    ("set_params.lua", SET_PARAMS_LUA),
    ("collect_usage.lua", COLLECT_USAGE_LUA),
    ("refund.lua", REFUND_LUA),
    ("charge.lua", CHARGE_LUA),
    ("hold.lua", HOLD_LUA),
    ("settle.lua", SETTLE_LUA),
];

/// The helper block of `src` (from the begin line to the end line) and the text around it.
fn split(name: &str, src: &str) -> (String, String) {
    let b = src
        .find(BEGIN)
        .unwrap_or_else(|| panic!("{name}: no '{BEGIN}' line"));
    let e = src[b..]
        .find(END)
        .unwrap_or_else(|| panic!("{name}: no '{END}' line"))
        + b
        + END.len();
    assert_eq!(src.matches(BEGIN).count(), 1, "{name}: one helper block");
    (src[b..e].to_string(), format!("{}{}", &src[..b], &src[e..]))
}

/// `local NAME = <integer>` lines of the block, by name.
fn constants(block: &str) -> Vec<(String, u64)> {
    block
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("local ")?;
            let (name, value) = rest.split_once(" = ")?;
            if !name.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                return None;
            }
            let digits = value.split_whitespace().next()?;
            digits.parse().ok().map(|v| (name.to_string(), v))
        })
        .collect()
}

#[test]
fn every_script_carries_the_same_helper_block() {
    let (first, _) = split(SCRIPTS[0].0, SCRIPTS[0].1);
    for (name, src) in &SCRIPTS[1..] {
        let (block, _) = split(name, src);
        assert!(
            block == first,
            "{name}: the helper block differs from {}'s; copy it verbatim",
            SCRIPTS[0].0
        );
    }
}

#[test]
fn lua_bounds_equal_quota_core_bounds() {
    let expected: &[(&str, u64)] = &[
        ("UT", UT),
        ("MAX_CAP", MAX_CAPACITY_UT),
        ("MAX_PERIOD", MAX_PERIOD_MS),
        ("DEFAULT_PERIOD_MS", DEFAULT_PERIOD_MS),
        ("MAX_FILL", MAX_FILL_BOUND_MS),
        ("MAX_WAIT", MAX_WAIT_MS),
        ("MAX_COST", MAX_BURST),
        ("MAX_LIMITS", MAX_LIMITS_PER_CHECK),
        ("MAX_WINDOW_LIMIT", MAX_WINDOW_LIMIT),
        ("MAX_WINDOW_MS", MAX_WINDOW_MS),
        ("MAX_WINDOW_PRODUCT", MAX_WINDOW_PRODUCT),
        ("EXACT_LOG_MAX", EXACT_LOG_MAX),
        ("DEFAULT_MIN_TTL_MS", DEFAULT_MIN_IDLE_TTL_MS),
        ("COLLECT_MAX", COLLECT_BATCH_MAX as u64),
        ("ONCE_MS", ONCE_KEY_MS),
        ("MAX_HOLD_TTL", MAX_HOLD_TTL_MS),
        ("HOLD_MEMORY_MS", HOLD_MEMORY_MS),
        ("MAX_HOLD_ID", MAX_HOLD_ID_LEN as u64),
        ("MAX_SLOTS", quota_core::policy::MAX_CONCURRENCY),
        // 12 doubles (see STATE_FMT), 11 in the layout without the period.
        ("STATE_LEN", 12 * 8),
        ("STATE_LEN_NO_PERIOD", 11 * 8),
    ];
    // The store's own cost bound is the policy's burst bound; the Lua MAX_CAP bounds refills.
    assert_eq!(MAX_COST, MAX_BURST);
    assert_eq!(MAX_REFILL_UT, MAX_CAPACITY_UT);
    let (block, _) = split(SCRIPTS[0].0, SCRIPTS[0].1);
    let found = constants(&block);
    for (name, value) in &found {
        let want = expected
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("Lua bound {name} has no quota-core counterpart here"));
        assert_eq!(*value, want.1, "Lua {name} differs from quota-core");
    }
    for (name, _) in expected {
        assert!(
            found.iter().any(|(n, _)| n == name),
            "{name} missing from the helper block"
        );
    }
    assert!(block.contains("local STATE_FMT = '<dddddddddddd'"));
    assert!(block.contains("local STATE_FMT_NO_PERIOD = '<ddddddddddd'"));
    // The default minimum TTL as a command argument, and the error prefix the Rust side reads.
    assert!(block.contains(&format!(
        "local DEFAULT_MIN_TTL_ARG = '{DEFAULT_MIN_IDLE_TTL_MS}'"
    )));
    assert!(block.contains("local ERR = 'ERR quotad: '"));
    assert!(block.contains("redis.error_reply('ERR quotad: ' .. what)"));
}

/// The parameter list of the factory, `quotad_helpers(...)`, as written in the block.
fn factory_params(block: &str) -> Vec<String> {
    let def = "local function quotad_helpers(";
    let start = block.find(def).expect("the block defines quotad_helpers") + def.len();
    let len = block[start..].find(')').unwrap();
    words(&block[start..start + len])
}

fn words(list: &str) -> Vec<String> {
    list.split(',').map(|w| w.trim().to_string()).collect()
}

#[test]
fn every_factory_call_passes_the_bounds_it_takes() {
    let (block, _) = split(SCRIPTS[0].0, SCRIPTS[0].1);
    let params = factory_params(&block);
    assert!(params.len() >= 10, "{params:?}");
    for (name, src) in SCRIPTS {
        let (_, rest) = split(name, src);
        let calls: Vec<&str> = rest.split("quotad_helpers(").skip(1).collect();
        assert!(!calls.is_empty(), "{name}: never makes the helpers");
        for call in calls {
            let args = &call[..call.find(')').unwrap()];
            assert_eq!(
                words(args),
                params,
                "{name}: quotad_helpers called with other arguments"
            );
        }
    }
}

#[test]
fn no_script_defines_bounds_or_helpers_outside_the_block() {
    for (name, src) in SCRIPTS {
        let (_, rest) = split(name, src);
        for l in rest.lines() {
            let t = l.trim_start();
            if t.starts_with("--") {
                continue; // a comment may name what the block holds
            }
            if let Some(r) = t.strip_prefix("local ") {
                let ident: String = r
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    !(ident.len() > 1 && ident.chars().all(|c| c.is_ascii_uppercase() || c == '_')),
                    "{name}: bound {ident} outside the helper block"
                );
            }
            for helper in [
                "function err(",
                "function int(",
                "function time_to(",
                "function refilled(",
                "function state_decode(",
                "function quotad_helpers(",
                "'TIME'",
            ] {
                // The decision scripts read TIME inline (see token_bucket.lua).
                if helper == "'TIME'"
                    && matches!(
                        name,
                        "token_bucket.lua" | "token_buckets.lua" | "sliding_window.lua"
                    )
                {
                    continue;
                }
                assert!(
                    !t.contains(helper),
                    "{name}: {helper} outside the helper block"
                );
            }
            // The bucket state's layout (11 or 12 doubles; sliding_window.lua packs counters
            // of its own).
            assert!(
                !t.contains("'<ddddddddddd"),
                "{name}: state layout outside the helper block"
            );
        }
    }
}

#[test]
fn the_block_is_found_by_the_checks() {
    // The checks above would pass vacuously on an empty block.
    let (block, _) = split(SCRIPTS[0].0, SCRIPTS[0].1);
    assert!(constants(&block).len() >= 12);
    assert!(block.contains("local function err(") && block.contains("local function int("));
    assert!(factory_params(&block).contains(&"MAX_CAP".to_string()));
}

#[test]
fn every_script_in_lua_is_checked() {
    // A new script must carry the block too: list it in SCRIPTS.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lua");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".lua"))
        .collect();
    found.sort();
    let mut listed: Vec<String> = SCRIPTS.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(found, listed);
}
