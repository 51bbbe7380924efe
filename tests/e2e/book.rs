//! The book includes code by anchor from files CI compiles; this checks that
//! every `{{#include}}` and every image it names still exists, so a renamed
//! anchor or a moved file fails the tests instead of silently emptying a page.
use std::path::Path;

#[test]
fn every_include_and_image_in_the_book_resolves() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("book/src");
    let mut checked = 0;
    for entry in std::fs::read_dir(&src).unwrap() {
        let page = entry.unwrap().path();
        if page.extension().and_then(|e| e.to_str()) != Some("md") {
            continue;
        }
        let text = std::fs::read_to_string(&page).unwrap();
        for (i, _) in text.match_indices("{{#include ") {
            let rest = &text[i + "{{#include ".len()..];
            let spec = &rest[..rest.find("}}").expect("closed include")];
            let (file, anchor) = spec.split_once(':').map_or((spec, None), |(f, a)| (f, Some(a)));
            let path = src.join(file);
            let body =
                std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("{}: missing {}", page.display(), file));
            if let Some(a) = anchor {
                assert!(body.contains(&format!("ANCHOR: {a}\n")), "{}: no `ANCHOR: {a}` in {file}", page.display());
                assert!(
                    body.contains(&format!("ANCHOR_END: {a}\n")),
                    "{}: no `ANCHOR_END: {a}` in {file}",
                    page.display()
                );
            }
            checked += 1;
        }
        for (i, _) in text.match_indices("](generated/") {
            let rest = &text[i + 2..];
            let file = &rest[..rest.find(')').unwrap()];
            assert!(src.join(file).exists(), "{}: missing image {file}", page.display());
            checked += 1;
        }
    }
    assert!(checked >= 10, "the book includes at least ten listings and figures ({checked} found)");
}

/// Every link between pages — `[text](page.md)` and `[text](page.md#heading)`
/// — points at a page of the book, and at a heading that page has; every
/// page in SUMMARY.md exists.
#[test]
fn every_internal_link_resolves() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("book/src");
    let pages: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".md"))
        .collect();
    // mdBook's heading ids: lower case, spaces to '-', other punctuation dropped.
    let ids = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| {
                l.trim_start_matches('#')
                    .trim()
                    .to_lowercase()
                    .chars()
                    .filter_map(|c| {
                        if c == ' ' {
                            Some('-')
                        } else if c.is_alphanumeric() || c == '-' || c == '_' {
                            Some(c)
                        } else {
                            None
                        }
                    })
                    .collect()
            })
            .collect()
    };
    let mut links = 0;
    for page in &pages {
        let text = std::fs::read_to_string(src.join(page)).unwrap();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(0)];
            if target.starts_with("http") || target.starts_with("generated/") || target.is_empty() {
                continue;
            }
            let (file, frag) = target.split_once('#').map_or((target, None), |(f, h)| (f, Some(h)));
            let file = if file.is_empty() { page.as_str() } else { file };
            assert!(pages.iter().any(|p| p == file), "{page}: link to {target}: no page {file}");
            if let Some(h) = frag {
                let body = std::fs::read_to_string(src.join(file)).unwrap();
                assert!(ids(&body).iter().any(|id| id == h), "{page}: link to {target}: {file} has no heading #{h}");
            }
            links += 1;
        }
    }
    assert!(links >= 8, "SUMMARY.md alone links every chapter ({links} links found)");
}
