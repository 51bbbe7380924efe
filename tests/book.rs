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
            let body = std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("{}: missing {}", page.display(), file));
            if let Some(a) = anchor {
                assert!(body.contains(&format!("ANCHOR: {a}\n")), "{}: no `ANCHOR: {a}` in {file}", page.display());
                assert!(body.contains(&format!("ANCHOR_END: {a}\n")), "{}: no `ANCHOR_END: {a}` in {file}", page.display());
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
