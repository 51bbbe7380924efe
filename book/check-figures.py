#!/usr/bin/env python3
"""Every figure the prose quotes from a listing is still in that listing.

A passage that quotes a listing says so just before it, in an HTML comment
(invisible in the rendered book):

    <!-- figures: generated/overlap.txt, generated/03-prefetch.txt -->
    The step falls from 234.0 to 164.7 ms (1.42×) …

The passage is the block that follows the comment, up to the next blank
line or the next such comment (a paragraph, or a run of list items; inside
a list, a comment indented as the item's text starts a new passage without
breaking the list). Each figure in it must appear in one of the named
listings as a whole number (not part of a longer one), a percentage as a
percentage (70%), a ratio as a ratio (1.42× or 1.42x). A figure is a
number with a decimal point (164.7, 0.25), one with thousands separators
(19,946), one in scientific notation (2.19e-2), one followed by × or %
(3×, 70%, and both ends of 87–94%), or a whole number in a unit the
listings print whole numbers in (392 ms, 40–66 MiB). Not figures: a
product of dimensions (8×64, 8 × 64), a setting ("a 64 KB burst",
"250 Mbit/s"), a three-part version (2.15.0), code spans, link targets.
A figure the prose works out from the listing's rather than copies (a
ratio of two of its times, a rounded one, say) is named after `derived:`,
so a reader of the source sees which ones they are; a range there names
both its ends:

    <!-- figures: generated/overlap.txt; derived: 3.1×, 87–94% -->

A regenerated listing that no longer holds a figure the prose quotes fails
`just book-verify`, naming the chapter, the line and the figure.

    python3 book/check-figures.py [BOOK_SRC]   # default: book/src
    python3 book/check-figures.py --self-test  # the checker on a made-up book
"""
import pathlib
import re
import sys
import tempfile

MARK = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->")
# The units a listing prints whole numbers in: times, resident sizes in MiB,
# clocks, rates of work. Sizes in kB, MB and GB the listings print with
# decimals, so a whole one in the prose is a setting ("a 64 KB burst", "an
# 80 GB card") or a rounding; a link's rate ("250 Mbit/s") is a setting.
UNIT = r"(?:ms|µs|MiB|MHz|GFLOP/s|tokens/s|tok/s)(?![\w/])"
FIGURE = re.compile(
    r"(?<![\w.,])("
    r"\d+(?:\.\d+)?e[-+]?\d+"                 # 2.19e-2
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?"          # 19,946
    r"|\d+\.\d+"                              # 164.7
    r"|\d+(?=(?:–\d+(?:\.\d+)?)?(?:×(?!\d)|%))"  # 3×, 70%, and the 87 of 87–94% (not 8×64)
    r"|\d+(?=(?:–\d+)?\s" + UNIT + ")"         # 392 ms, 40–66 MiB
    r")[×%x]?(?![\w]|[.,]\d)")                 # not part of a longer one (torch 2.15.0)
RANGE = re.compile(r"(?<=\d)[–-](?=\d)")


def figures(text):
    """The figures of a passage, as written (without ×, %), each with where it
    starts and its kind: "%", "×" (x too), or "" for a plain number. The low
    end of a range has the kind of its high end (the 87 of 87–94%)."""
    for m in FIGURE.finditer(text):
        kind = re.match(r"(?:–\d+(?:\.\d+)?)?([×x%]?)", text[m.end(1):]).group(1).replace("x", "×")
        yield m.group(1), m.start(1), kind


def holds(listing, figure, kind=""):
    """Whether `figure` appears in the listing as a whole number, followed by
    % if it is a percentage, by × (or x) if it is a ratio."""
    after = {"%": "%", "×": "[×x]", "": ""}[kind]
    return re.search(r"(?<![\d.,])" + re.escape(figure) + r"(?![\d]|[.,]\d)" + after, listing) is not None


def passages(md):
    """(line number of the marker, its listings, its derived figures, the passage's lines)."""
    lines = md.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = MARK.search(line)
        if not m:
            continue
        spec, _, derived = m.group(1).partition(";")
        names = [n.strip() for n in spec.split(",") if n.strip()]
        derived = derived.strip()
        if derived and not derived.startswith("derived:"):
            yield i + 1, names, None, []
            continue
        exempt = [end.strip().rstrip("×%x")
                  for d in re.split(r",(?!\d)", derived[len("derived:"):]) if d.strip()  # not 17,000's comma
                  for end in RANGE.split(d.strip())]
        block, j = [], i + 1
        while j < len(lines) and lines[j].strip() and not MARK.search(lines[j]):
            block.append((j + 1, lines[j]))
            j += 1
        yield i + 1, names, exempt, block


def readable(block):
    """The passage as one text, code spans and link targets blanked (they may
    run over a line's end), and the line number of each of its characters."""
    text = "\n".join(line for _, line in block)
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())
    text = re.sub(r"`[^`]*`", blank, text)  # code spans: flags and names, not figures
    text = re.sub(r"(?<=\])\([^)]*\)", blank, text)  # link targets
    first = block[0][0]
    return text, lambda at: first + text.count("\n", 0, at)


def check(book, out=print):
    """Check every marked passage of the book's chapters; the number of failures."""
    failed, checked, marks = 0, 0, 0
    for md in sorted(book.glob("*.md")):
        for at, names, exempt, block in passages(md):
            marks += 1
            where = f"{md.name}:{at}"
            if exempt is None:
                out(f"✗ {where}: write the marker as <!-- figures: LISTING, …; derived: FIGURE, … -->")
                failed += 1
                continue
            if not names:
                out(f"✗ {where}: the marker names no listing")
                failed += 1
                continue
            texts = []
            for name in names:
                path = book / name
                if not path.is_file():
                    out(f"✗ {where}: no listing {name}")
                    failed += 1
                    continue
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
            if not block:
                out(f"✗ {where}: the marker quotes nothing (no passage follows it)")
                failed += 1
                continue
            text, line_of = readable(block)
            seen = set()
            for fig, start, kind in figures(text):
                seen.add(fig)
                if fig in exempt:
                    continue
                checked += 1
                if not any(holds(t, fig, kind) for t in texts):
                    out(f"✗ {md.name}:{line_of(start)}: {fig}{kind} is in none of {', '.join(names)}")
                    failed += 1
            for d in exempt:
                if d not in seen:
                    out(f"✗ {where}: derived figure {d} is not in the passage")
                    failed += 1
    out(f"{checked} quoted figures checked in {marks} passages")
    if marks == 0:
        out("✗ no passage is marked: nothing was checked")
        failed += 1
    return failed


def self_test():
    """The checker on a made-up book of one listing and one chapter, a case at
    a time: a figure the listing holds passes, one it lost fails, and so do
    a derived figure the prose lacks, a listing that is not there and a
    marker with nothing after it. The number of failures each case expects."""
    listing = ("step 164.7 ms against 234.0 ms: 1.42× its twin's; 70% hidden; 19,946 tok/s; max |Δw| 2.19e-2;\n"
               "391 of 392 ms on the wire\n")
    cases = [  # (what it checks, the passage after the marker, how many failures)
        ("quoted figures, all in the listing",
         "<!-- figures: generated/run.txt; derived: 3.1×, 87–94%, 17,000 -->\n"
         "From 234.0 to 164.7 ms (1.42×, 70% hidden), 19,946 tokens/s, at most 2.19e-2;\n"
         "3.1 times FSDP2's step, 87–94% of the peak, about 17,000 tokens, micro-batches of 8 × 64 tokens\n"
         "on a 250 Mbit/s link with a 64 KB burst (torch 2.15.0), 391 of 392 ms on the wire, 8×64 tokens\n"
         "(`--bucket-mb 0.1`, [a link](https://example.org/v1.5)).\n"
         "\n"
         "After the blank line: 999.9 ms, not the marker's passage.\n", 0),
        ("a figure the listing lost", "<!-- figures: generated/run.txt -->\nThe step took 164.8 ms.\n", 1),
        ("a longer number is not the figure", "<!-- figures: generated/run.txt -->\nAbout 64.7 ms and 1.4× here.\n", 2),
        ("a range's other end", "<!-- figures: generated/run.txt -->\nHidden: 60–70%.\n", 1),
        ("a percentage where the listing has that number, not that percentage",
         "<!-- figures: generated/run.txt -->\n164.7% of it, 1.42% more.\n", 2),
        ("a whole number of milliseconds", "<!-- figures: generated/run.txt -->\nIt took 165 ms, 391 of 392 ms on the wire.\n", 1),
        ("a derived figure the prose lacks", "<!-- figures: generated/run.txt; derived: 3.1× -->\nThe step took 164.7 ms.\n", 1),
        ("a listing that is not there", "<!-- figures: generated/gone.txt -->\nThe step took 164.7 ms.\n", 2),
        ("a marker with nothing after it", "<!-- figures: generated/run.txt -->\n\nThe step took 164.7 ms.\n", 1),
        ("a badly written marker", "<!-- figures: generated/run.txt; 3.1× -->\nThe step took 164.7 ms.\n", 1),
        ("a list, a marker per item",
         "<!-- figures: generated/run.txt -->\n- 164.7 ms here;\n  <!-- figures: generated/run.txt; derived: 3.1× -->\n- 3.1× there.\n", 0),
        ("the next marker ends a passage",
         "<!-- figures: generated/run.txt; derived: 3.1× -->\n3.1× here;\n<!-- figures: generated/run.txt -->\nand 3.1× there.\n", 1),
    ]
    bad = 0
    for what, chapter, expected in cases:
        with tempfile.TemporaryDirectory() as tmp:
            book = pathlib.Path(tmp)
            (book / "generated").mkdir()
            (book / "generated" / "run.txt").write_text(listing, encoding="utf-8")
            (book / "ch01.md").write_text("# A chapter\n\n" + chapter, encoding="utf-8")
            said = []
            got = check(book, said.append)
        if got == expected:
            print(f"✓ self-test: {what}")
        else:
            bad += 1
            print(f"✗ self-test: {what}: {got} failures, expected {expected}:")
            for line in said:
                print(f"    {line}")
    return bad


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(1 if self_test() else 0)
    book = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent / "src"
    sys.exit(1 if check(book) else 0)
