//! A timeline on a real time axis: one row per lane (a rank's compute
//! thread, its communication), each a run of coloured bars — what the
//! traces of `--trace` show, drawn for the book.
use crate::plot::{esc, label, nice_step, ticks};

/// One bar: from `start` to `end` (the panel's time unit), a colour, and
/// what it was (shown when the mouse is over it).
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub start: f64,
    pub end: f64,
    pub color: &'static str,
    pub what: String,
    /// Drawn thinner, over the bars before it (a wait inside a compute span).
    pub inner: bool,
}

/// One lane.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub name: String,
    pub bars: Vec<Bar>,
}

/// One panel: rows stacked on a shared time axis from `t0` to `t1`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    pub title: String,
    pub x_label: String,
    pub t0: f64,
    pub t1: f64,
    pub rows: Vec<Row>,
    /// The colours' meanings, under the panels.
    pub legend: Vec<(String, &'static str)>,
}

const W: f64 = 900.0;
const LEFT: f64 = 130.0;
const RIGHT: f64 = 20.0;
const ROW: f64 = 26.0;
const TITLE: f64 = 34.0;
const AXIS: f64 = 40.0;

/// The panels stacked vertically in one SVG document, one legend (the first panel's) under them.
pub fn timeline_svg(panels: &[Timeline]) -> String {
    let heights: Vec<f64> = panels.iter().map(|p| TITLE + ROW * p.rows.len() as f64 + AXIS).collect();
    let legend = panels.first().map_or(0, |p| p.legend.len()).div_ceil(4) as f64 * 18.0 + 10.0;
    let height = heights.iter().sum::<f64>() + legend;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{height}\" viewBox=\"0 0 {W} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let mut y = 0.0;
    for (p, h) in panels.iter().zip(&heights) {
        s.push_str(&format!("<g transform=\"translate(0,{y})\">\n"));
        s.push_str(&p.render());
        s.push_str("</g>\n");
        y += h;
    }
    if let Some(p) = panels.first() {
        for (i, (name, color)) in p.legend.iter().enumerate() {
            let (lx, ly) = (LEFT + (i % 4) as f64 * 185.0, y + 8.0 + 18.0 * (i / 4) as f64);
            s.push_str(&format!("<rect x=\"{lx}\" y=\"{ly}\" width=\"14\" height=\"12\" fill=\"{color}\"/>\n"));
            s.push_str(&format!("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 20.0, ly + 10.0, esc(name)));
        }
    }
    s.push_str("</svg>\n");
    s
}

impl Timeline {
    fn render(&self) -> String {
        let (t0, t1) = (self.t0, if self.t1 > self.t0 { self.t1 } else { self.t0 + 1.0 });
        let pw = W - LEFT - RIGHT;
        let sx = |t: f64| LEFT + (t.clamp(t0, t1) - t0) / (t1 - t0) * pw;
        let bottom = TITLE + ROW * self.rows.len() as f64;
        let mut s = format!(
            "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
            W / 2.0,
            esc(&self.title)
        );
        let step = nice_step((t1 - t0) / 8.0);
        for t in ticks(t0, t1, step) {
            s.push_str(&format!(
                "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{TITLE}\" y2=\"{bottom}\" stroke=\"#eee\"/>\n<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                bottom + 16.0,
                label(t - t0, step, (t1 - t0).abs()),
                x = sx(t)
            ));
        }
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            LEFT + pw / 2.0,
            bottom + 34.0,
            esc(&self.x_label)
        ));
        for (i, row) in self.rows.iter().enumerate() {
            let y = TITLE + ROW * i as f64;
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                LEFT - 8.0,
                y + ROW / 2.0 + 4.0,
                esc(&row.name)
            ));
            s.push_str(&format!(
                "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ccc\"/>\n",
                LEFT + pw,
                y + ROW - 1.0,
                y + ROW - 1.0
            ));
            for b in row.bars.iter().filter(|b| b.end > t0 && b.start < t1) {
                let (x0, x1) = (sx(b.start), sx(b.end));
                let (by, bh) = if b.inner { (y + 9.0, ROW - 16.0) } else { (y + 3.0, ROW - 6.0) };
                s.push_str(&format!(
                    "<rect x=\"{x0:.2}\" y=\"{by:.1}\" width=\"{:.2}\" height=\"{bh:.1}\" fill=\"{}\" stroke=\"white\" stroke-width=\"0.3\"><title>{}</title></rect>\n",
                    (x1 - x0).max(0.4),
                    b.color,
                    esc(&b.what)
                ));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_land_at_their_times_and_the_same_input_gives_the_same_bytes() {
        let bar = |start, end, inner| Bar { start, end, color: "#1f77b4", what: "forward h.0 <1>".into(), inner };
        let panel = Timeline {
            title: "rank 0".into(),
            x_label: "ms".into(),
            t0: 10.0,
            t1: 20.0,
            rows: vec![Row { name: "compute".into(), bars: vec![bar(10.0, 15.0, false), bar(12.0, 13.0, true)] }],
            legend: vec![("forward".into(), "#1f77b4")],
        };
        let svg = timeline_svg(std::slice::from_ref(&panel));
        assert_eq!(svg, timeline_svg(&[panel]));
        // 10..15 of 10..20 is the left half of the 750-pixel-wide plot.
        assert!(svg.contains("x=\"130.00\" y=\"37.0\" width=\"375.00\""), "{svg}");
        assert!(svg.contains("<title>forward h.0 &lt;1&gt;</title>"), "labels are escaped");
    }
}
