//! Boxed text tables, llm.c style: `| Parameter | Value |`.

/// A table with a header row; columns after the first are right-aligned.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Option<Vec<String>>>, // None = a separator line
}

impl Table {
    pub fn new<S: ToString>(header: impl IntoIterator<Item = S>) -> Self {
        Self { header: header.into_iter().map(|s| s.to_string()).collect(), rows: vec![] }
    }

    pub fn row<S: ToString>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Self {
        self.rows.push(Some(cells.into_iter().map(|s| s.to_string()).collect()));
        self
    }

    pub fn separator(&mut self) -> &mut Self {
        self.rows.push(None);
        self
    }

    /// Renders with box-drawing characters; the first column is left-aligned.
    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut w = vec![0; n];
        for cells in std::iter::once(&self.header).chain(self.rows.iter().flatten()) {
            for (i, c) in cells.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |l: &str, m: &str, r: &str| {
            let mut s = l.to_string();
            for (i, wi) in w.iter().enumerate() {
                s.push_str(&"─".repeat(wi + 2));
                s.push_str(if i + 1 == n { r } else { m });
            }
            s.push('\n');
            s
        };
        let cells = |cs: &[String]| {
            let mut s = String::from("│");
            for (i, wi) in w.iter().enumerate() {
                let c = cs.get(i).map(String::as_str).unwrap_or("");
                let pad = wi - c.chars().count();
                if i == 0 {
                    s.push_str(&format!(" {c}{} │", " ".repeat(pad)));
                } else {
                    s.push_str(&format!(" {}{c} │", " ".repeat(pad)));
                }
            }
            s.push('\n');
            s
        };
        let mut out = line("┌", "┬", "┐");
        out.push_str(&cells(&self.header));
        out.push_str(&line("├", "┼", "┤"));
        for r in &self.rows {
            match r {
                Some(cs) => out.push_str(&cells(cs)),
                None => out.push_str(&line("├", "┼", "┤")),
            }
        }
        out.push_str(&line("└", "┴", "┘"));
        out
    }
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Bytes in decimal megabytes with two decimals (the unit of the ZeRO paper and the classic toy).
pub fn mb(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

/// Bytes as [`mb`] writes them, or below 0.1 MB in bytes, where two decimals
/// of a megabyte would round a size away (`--mem-budget 1KB`: "1,000 bytes",
/// not "0.00 MB").
pub fn mb_or_bytes(bytes: u64) -> String {
    if bytes < 100_000 { format!("{} bytes", thousands(bytes)) } else { mb(bytes) }
}

/// A measured size (heap, RSS), to one decimal: it moves by a few tens of KB
/// from run to run, so a learner's run shows the figure the book shows.
pub fn mb_measured(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// Scientific notation as C's `%.2e` writes it: `0.00e+00`, `1.25e-07`.
pub fn sci(x: f64) -> String {
    let s = format!("{x:.2e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s, // NaN, inf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned_boxes() {
        let mut t = Table::new(["what", "n"]);
        t.row(["a", "1"]).separator().row(["longer", "12,345"]);
        let want = "\
┌────────┬────────┐
│ what   │      n │
├────────┼────────┤
│ a      │      1 │
├────────┼────────┤
│ longer │ 12,345 │
└────────┴────────┘
";
        assert_eq!(t.render(), want);
        assert_eq!(thousands(809_856), "809,856");
        assert_eq!(thousands(12), "12");
        assert_eq!(mb(3_239_424), "3.24 MB");
        assert_eq!(sci(0.0), "0.00e+00");
        assert_eq!(sci(1.25e-7), "1.25e-07");
        assert_eq!(sci(f64::NAN), "NaN");
    }
}
