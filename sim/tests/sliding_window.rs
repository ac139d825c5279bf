//! The sliding-window table (`sim::sliding_window`) at the default suite's seed, regions and
//! duration: quotad never admits more than N in any window, while applying moved shares at
//! once does, and splitting for ever never does.

use sim::sliding_window::{self, WindowStrategy, POLICIES};

#[test]
fn quotad_holds_every_window_to_its_limit_and_shares_at_once_do_not() {
    let rows = sliding_window::run(1, 3, 360_000);
    assert_eq!(rows.len(), POLICIES.len() * WindowStrategy::ALL.len());
    let worst = |s: WindowStrategy| {
        rows.iter()
            .filter(|r| r.strategy == s)
            .map(|r| r.overshoot_window)
            .fold(0.0f64, f64::max)
    };
    assert!(worst(WindowStrategy::Quotad) <= 1.0, "{rows:#?}");
    assert!(worst(WindowStrategy::StaticSplit) <= 1.0, "{rows:#?}");
    assert!(worst(WindowStrategy::SharesAtOnce) > 1.02, "{rows:#?}");
    assert!(worst(WindowStrategy::Independent) > 1.5, "{rows:#?}");
    for r in &rows {
        assert!(r.requests > 0 && r.goodput > 0.0, "{r:?}");
    }
    println!("{}", sliding_window::table(&rows));
}

/// sim/README.md shows the table this run prints, and quotes figures of it.
#[test]
fn the_readme_shows_this_table() {
    let rows = sliding_window::run(1, 3, 360_000);
    let table = sliding_window::table(&rows);
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("sim/README.md");
    let marker = "<!-- sliding-window table -->\n";
    let at = readme.find(marker).expect("the table's marker") + marker.len();
    let shown: String = readme[at..]
        .lines()
        .take_while(|l| l.starts_with('|'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(shown, table, "regenerate the table in sim/README.md");
    // The figures the notes below it quote.
    let notes = &readme[at + shown.len()..];
    let notes = &notes[..notes.find("\n## ").unwrap_or(notes.len())];
    for quoted in notes
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|w| w.len() == 5 && w.as_bytes()[1] == b'.')
    {
        assert!(table.contains(quoted), "{quoted} is not in the table");
    }
}
