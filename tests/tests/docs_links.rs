//! Every relative link in the documentation resolves: README.md, every `docs/**/*.md` and
//! `sim/README.md` are read, each Markdown link that is not a URL is resolved against the
//! linking file's directory, and a `#fragment` must name a heading of the linked Markdown file
//! (or of the same file, for a bare `#fragment`), as GitHub renders heading anchors. Links in
//! code blocks and code spans are not links and are skipped.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// The documents whose links are checked, relative to the workspace root.
fn documents(root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut docs = vec![root.join("README.md"), root.join("sim/README.md")];
    walk(&root.join("docs"), &mut docs);
    docs.sort();
    docs
}

/// The lines outside fenced code blocks, with their numbers.
fn outside_fences(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let marker: String = line
            .trim_start()
            .chars()
            .take_while(|c| *c == '`' || *c == '~')
            .collect();
        if marker.len() >= 3 && marker.chars().all(|c| marker.starts_with(c)) {
            match &fence {
                None => fence = Some(marker),
                Some(open) if marker.starts_with(open.as_str()) => fence = None,
                Some(_) => {}
            }
            continue;
        }
        if fence.is_none() {
            out.push((i + 1, line));
        }
    }
    out
}

/// The prose lines: outside fenced code blocks, with code spans blanked.
fn prose(text: &str) -> Vec<(usize, String)> {
    outside_fences(text)
        .into_iter()
        .map(|(n, line)| (n, blank_code_spans(line)))
        .collect()
}

/// `line` with every code span (`` `…` ``, ``` ``…`` ```) replaced by spaces.
fn blank_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| **c == '`').count();
        let close = (i + run..chars.len()).find(|&j| {
            chars[j..].iter().take_while(|c| **c == '`').count() == run
                && (j == 0 || chars[j - 1] != '`')
        });
        match close {
            Some(j) => {
                out.extend(std::iter::repeat_n(' ', j + run - i));
                i = j + run;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// The targets of the inline links `[text](target)` and reference definitions `[x]: target`
/// in one line of prose.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let trimmed = line.trim_start();
    if let Some(rest) = trimmed.strip_prefix('[') {
        if let Some(end) = rest.find("]:") {
            if let Some(target) = rest[end + 2..].split_whitespace().next() {
                out.push(target.trim_matches(['<', '>']).to_string());
            }
            return out;
        }
    }
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else {
            break;
        };
        let inside = after[..end].trim();
        // `[text](target "title")`: the target is the first word.
        if let Some(target) = inside.split_whitespace().next() {
            out.push(target.trim_matches(['<', '>']).to_string());
        }
        rest = &after[end + 1..];
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces
/// as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown document's headings (a repeated heading gets `-1`, `-2`, …).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in outside_fences(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..].replace('`', ""));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// `path` with `.` and `..` resolved lexically.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Why `target`, linked from `doc`, does not resolve, or `None` if it does.
fn broken(doc: &Path, doc_text: &str, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let (file, text) = if path.is_empty() {
        (doc.to_path_buf(), doc_text.to_string())
    } else {
        let file = normalize(&doc.parent().unwrap().join(path));
        if !file.exists() {
            return Some("no such file".to_string());
        }
        let text = if file.extension().is_some_and(|e| e == "md") {
            std::fs::read_to_string(&file).unwrap_or_default()
        } else {
            String::new()
        };
        (file, text)
    };
    match fragment {
        Some(f) if !f.is_empty() && file.extension().is_some_and(|e| e == "md") => {
            (!anchors(&text).contains(f)).then(|| format!("no heading with anchor #{f}"))
        }
        _ => None,
    }
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = root();
    let docs = documents(&root);
    assert!(
        docs.len() >= 3,
        "expected README.md, sim/README.md and docs/: {docs:?}"
    );
    let mut problems = Vec::new();
    let mut links = 0;
    for doc in &docs {
        let text =
            std::fs::read_to_string(doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        for (line_no, line) in prose(&text) {
            for target in link_targets(&line) {
                links += 1;
                if let Some(why) = broken(doc, &text, &target) {
                    let shown = doc.strip_prefix(&root).unwrap_or(doc);
                    problems.push(format!("{}:{line_no}: ({target}) {why}", shown.display()));
                }
            }
        }
    }
    assert!(links > 0, "no links found: the extractor is broken");
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn links_are_found_outside_code_only() {
    let text = "see [a](a.md) and [b](b.md#x \"t\")\n`[c](c.md)` ``[d](`d`)``\n```\n[e](e.md)\n```\n[f]: f.md\n";
    let found: Vec<String> = prose(text)
        .iter()
        .flat_map(|(_, l)| link_targets(l))
        .collect();
    assert_eq!(found, ["a.md", "b.md#x", "f.md"]);
}

#[test]
fn anchors_follow_github_slugs() {
    let text = "# Lease safety\n## The allocator, the Raft log and snapshots\n### `quotad` over HTTP\n## Lease safety\n```\n# not a heading\n```\n#hashtag\n";
    let a = anchors(text);
    let want: BTreeSet<String> = [
        "lease-safety",
        "the-allocator-the-raft-log-and-snapshots",
        "quotad-over-http",
        "lease-safety-1",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(a, want);
}

#[test]
fn broken_links_and_anchors_are_named() {
    let root = root();
    let readme = root.join("README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    assert_eq!(
        broken(&readme, &text, "no/such/file.md").as_deref(),
        Some("no such file")
    );
    assert!(broken(&readme, &text, "#no-such-heading").is_some());
    assert!(broken(&readme, &text, "docs/architecture.md#no-such-heading").is_some());
    assert_eq!(
        broken(&readme, &text, "docs/architecture.md#lease-safety"),
        None
    );
    assert_eq!(broken(&readme, &text, "https://example.invalid/x"), None);
}
