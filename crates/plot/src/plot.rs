//! Small SVG line charts, written by hand: no plotting dependency, and the
//! same input always gives the same bytes (so figures can be regenerated
//! and diffed).

/// One line on a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub points: Vec<(f64, f64)>,
    /// Dashed lines let a second series stay visible on top of the first.
    pub dashed: bool,
}

/// One panel: axes, labels, and its series.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Fixed y range; by default the data's range with a margin.
    pub y_range: Option<(f64, f64)>,
    /// The y axis starts at zero (amounts, such as bytes: a bar that starts
    /// elsewhere exaggerates every difference).
    pub y_from_zero: bool,
    /// Named x positions (the events of a step), written slanted under the
    /// axis instead of numbers.
    pub x_names: Vec<(f64, String)>,
}

const W: f64 = 520.0;
const H: f64 = 340.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// Room under the axis for slanted names (`Chart::x_names`).
const NAMES: f64 = 150.0;

/// More series than this get their legend under the panel, in two columns,
/// where it covers no line.
const LEGEND_INSIDE: usize = 6;

/// Height of a legend under the panel for `n` series (none for a few).
fn legend_under(n: usize) -> f64 {
    if n > LEGEND_INSIDE { 16.0 * n.div_ceil(2) as f64 + 8.0 } else { 0.0 }
}

/// Lays the charts out side by side in one SVG document.
pub fn svg(charts: &[Chart]) -> String {
    let width = W * charts.len() as f64;
    let below = if charts.iter().any(|c| !c.x_names.is_empty()) { NAMES } else { 0.0 };
    let height = H + below + charts.iter().map(|c| legend_under(c.series.len())).fold(0.0, f64::max);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, c) in charts.iter().enumerate() {
        s.push_str(&format!("<g transform=\"translate({},0)\">\n", i as f64 * W));
        s.push_str(&c.render(below));
        s.push_str("</g>\n");
    }
    s.push_str("</svg>\n");
    s
}

impl Chart {
    /// The panel, with `below` extra pixels under the axis for slanted names.
    fn render(&self, below: f64) -> String {
        // Non-finite values (a diverged loss) are left out, not allowed to break the chart.
        let pts = self.series.iter().flat_map(|s| s.points.iter()).filter(|(x, y)| x.is_finite() && y.is_finite());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 == x0 {
            x1 = x0 + 1.0;
        }
        if self.y_from_zero {
            y0 = y0.min(0.0);
        }
        let (y0, y1) = match self.y_range {
            Some(r) => r,
            None if y1 == y0 => (y0 - 1.0, y1 + 1.0),
            None if self.y_from_zero => (y0, y1 + 0.08 * (y1 - y0)),
            None => (y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)),
        };
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;
        let mut s = String::new();
        s.push_str(&format!(
            "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
            W / 2.0,
            esc(&self.title)
        ));
        s.push_str(&format!(
            "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n"
        ));
        // Grid lines and labels at round values ("15,000", not "1.5e4").
        let y_step = nice_step((y1 - y0) / 4.0);
        let y_scale = y0.abs().max(y1.abs());
        for yv in ticks(y0, y1, y_step) {
            s.push_str(&format!(
                "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\n",
                LEFT + pw,
                sy(yv),
                sy(yv)
            ));
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                LEFT - 6.0,
                sy(yv) + 4.0,
                label(yv, y_step, y_scale)
            ));
        }
        // x: a few whole-number positions (ranks 1, 2, 4) are labelled as they are; else round values.
        let mut xs: Vec<f64> = self.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let (x_ticks, x_step) = if !xs.is_empty() && xs.len() <= 8 && xs.iter().all(|x| x.fract() == 0.0) {
            (xs, 1.0)
        } else {
            let step = nice_step((x1 - x0) / 4.0);
            (ticks(x0, x1, step), step)
        };
        let x_scale = x0.abs().max(x1.abs());
        if self.x_names.is_empty() {
            for xv in x_ticks {
                s.push_str(&format!(
                    "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                    sx(xv),
                    TOP + ph + 16.0,
                    label(xv, x_step, x_scale)
                ));
            }
        }
        for (xv, name) in &self.x_names {
            // Slanted, ending at its tick, so that long names do not overlap.
            let (x, y) = (sx(*xv) + 3.0, TOP + ph + 10.0);
            s.push_str(&format!(
                "<text transform=\"translate({x:.1},{y:.1}) rotate(-60)\" text-anchor=\"end\" font-size=\"9\">{}</text>\n",
                esc(name)
            ));
        }
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            LEFT + pw / 2.0,
            H + below - 10.0,
            esc(&self.x_label)
        ));
        s.push_str(&format!(
            "<text transform=\"translate(16,{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            TOP + ph / 2.0,
            esc(&self.y_label)
        ));
        let lines: Vec<Vec<(f64, f64)>> = self
            .series
            .iter()
            .map(|ser| {
                ser.points
                    .iter()
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .map(|&(x, y)| (sx(x), sy(y.clamp(y0, y1))))
                    .collect()
            })
            .collect();
        for (ser, line) in self.series.iter().zip(&lines) {
            let path: Vec<String> = line.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let dash = if ser.dashed { " stroke-dasharray=\"6 4\"" } else { "" };
            s.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
                ser.color,
                path.join(" ")
            ));
        }
        if self.series.len() > LEGEND_INSIDE {
            // Under the panel, two columns.
            for (i, ser) in self.series.iter().enumerate() {
                let dash = if ser.dashed { " stroke-dasharray=\"6 4\"" } else { "" };
                let (lx, ly) = (LEFT + (i % 2) as f64 * pw / 2.0, H + below + 4.0 + 16.0 * (i / 2) as f64);
                s.push_str(&format!("<line x1=\"{lx:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\n", lx + 24.0, ser.color));
                s.push_str(&format!("<text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n", lx + 30.0, ly + 4.0, esc(&ser.name)));
            }
            return s;
        }
        // The legend goes where the lines cross it least (a corner, else the
        // middle of a side), on a white box.
        let widest = self.series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0) as f64;
        let (bw, bh) = (36.0 + 6.6 * widest, 8.0 + 16.0 * self.series.len() as f64);
        let (right, left, mid) = (LEFT + pw - bw - 6.0, LEFT + 6.0, TOP + (ph - bh) / 2.0);
        let corners = [
            (right, TOP + 6.0),
            (left, TOP + 6.0),
            (right, TOP + ph - bh - 6.0),
            (left, TOP + ph - bh - 6.0),
            (right, mid),
            (left, mid),
        ];
        let crossings = |(bx, by): (f64, f64)| -> usize {
            let inside = |(x, y): (f64, f64)| x >= bx && x <= bx + bw && y >= by && y <= by + bh;
            lines
                .iter()
                .flat_map(|l| l.windows(2))
                .map(|w| {
                    (0..=20)
                        .filter(|k| {
                            let t = *k as f64 / 20.0;
                            inside((w[0].0 + t * (w[1].0 - w[0].0), w[0].1 + t * (w[1].1 - w[0].1)))
                        })
                        .count()
                })
                .sum()
        };
        let (bx, by) = corners.iter().copied().min_by_key(|&c| crossings(c)).expect("six places");
        if !self.series.is_empty() {
            s.push_str(&format!("<rect x=\"{bx:.1}\" y=\"{by:.1}\" width=\"{bw:.1}\" height=\"{bh:.1}\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n"));
        }
        for (i, ser) in self.series.iter().enumerate() {
            let dash = if ser.dashed { " stroke-dasharray=\"6 4\"" } else { "" };
            let ly = by + 12.0 + 16.0 * i as f64;
            s.push_str(&format!("<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\n", bx + 6.0, bx + 30.0, ser.color));
            s.push_str(&format!("<text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n", bx + 36.0, ly + 4.0, esc(&ser.name)));
        }
        s
    }
}

/// One panel of stacked bars: each bar a label and its segments' values,
/// bottom first, in the order of `segments` (name, colour); the y axis
/// starts at zero.
#[derive(Debug, Clone, Default)]
pub struct Bars {
    pub title: String,
    pub y_label: String,
    pub segments: Vec<(String, &'static str)>,
    pub bars: Vec<(String, Vec<f64>)>,
}

/// Stacked-bar panels side by side in one SVG document, one legend under them.
pub fn bars_svg(panels: &[Bars]) -> String {
    let width = W * panels.len() as f64;
    let legend = 22.0 * panels.first().map_or(0, |p| p.segments.len()) as f64;
    let height = H + legend;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, p) in panels.iter().enumerate() {
        s.push_str(&format!("<g transform=\"translate({},0)\">\n", i as f64 * W));
        s.push_str(&p.render());
        s.push_str("</g>\n");
    }
    if let Some(p) = panels.first() {
        for (k, (name, color)) in p.segments.iter().enumerate() {
            let y = H + 4.0 + 22.0 * k as f64;
            s.push_str(&format!("<rect x=\"{LEFT}\" y=\"{y:.1}\" width=\"14\" height=\"14\" fill=\"{color}\"/>\n"));
            s.push_str(&format!("<text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n", LEFT + 20.0, y + 11.0, esc(name)));
        }
    }
    s.push_str("</svg>\n");
    s
}

impl Bars {
    fn render(&self) -> String {
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let top = self.bars.iter().map(|(_, v)| v.iter().sum::<f64>()).fold(0.0, f64::max).max(1e-9) * 1.08;
        let sy = |y: f64| TOP + ph - y / top * ph;
        let mut s = format!(
            "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
            W / 2.0,
            esc(&self.title)
        );
        s.push_str(&format!(
            "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n"
        ));
        let step = nice_step(top / 4.0);
        for yv in ticks(0.0, top, step) {
            s.push_str(&format!(
                "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\n",
                LEFT + pw,
                sy(yv),
                sy(yv)
            ));
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                LEFT - 6.0,
                sy(yv) + 4.0,
                label(yv, step, top)
            ));
        }
        s.push_str(&format!(
            "<text transform=\"translate(16,{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            TOP + ph / 2.0,
            esc(&self.y_label)
        ));
        let slot = pw / self.bars.len().max(1) as f64;
        for (i, (name, values)) in self.bars.iter().enumerate() {
            let x = LEFT + slot * i as f64 + slot * 0.2;
            let mut base = 0.0;
            for (v, (_, color)) in values.iter().zip(&self.segments) {
                let (y0, y1) = (sy(base), sy(base + v));
                s.push_str(&format!(
                    "<rect x=\"{x:.1}\" y=\"{y1:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>\n",
                    slot * 0.6,
                    (y0 - y1).max(0.0)
                ));
                base += v;
            }
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
                x + slot * 0.3,
                sy(base) - 5.0,
                label(base, if base >= 100.0 { 1.0 } else { 0.1 }, base)
            ));
            s.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                x + slot * 0.3,
                TOP + ph + 16.0,
                esc(name)
            ));
        }
        s
    }
}

/// A round step near `raw`: 1, 2, 2.5 or 5 times a power of ten.
pub(crate) fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    // 2.5 only where it stays on the grid of the labels' digits (0.25, 25, 250 — not 2.5).
    let quarter = p != 1.0;
    p * if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 2.5 && quarter {
        2.5
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    }
}

/// The multiples of `step` in `[lo, hi]` (none for a range that is not finite, or absurdly many).
pub(crate) fn ticks(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let (first, last) = ((lo / step).ceil(), (hi / step + 1e-9).floor());
    if !(first.is_finite() && last.is_finite()) || last - first > 50.0 {
        return vec![];
    }
    (first as i64..=last as i64).map(|k| k as f64 * step).collect()
}

/// A tick label with as many decimals as the step needs: "15,000", "3.5",
/// "0.25", "2.71828"; an axis whose values are all tiny (below 0.01) in
/// scientific notation ("-5.0e-7"). `scale` is the axis' largest magnitude.
pub(crate) fn label(v: f64, step: f64, scale: f64) -> String {
    if v.abs() < step * 1e-6 {
        return "0".into();
    }
    if step < 1e-3 && scale < 1e-2 {
        return format!("{v:.1e}");
    }
    let decimals = match step >= 1.0 {
        true => 0,
        false => {
            let d = (-step.log10()).ceil();
            let scaled = step * 10f64.powi(d as i32); // 2.5 for a step of 0.25: one more decimal
            (d as usize + usize::from((scaled - scaled.round()).abs() > 1e-9)).min(12)
        }
    };
    let text = format!("{v:.decimals$}");
    // Thousands separators in the whole part.
    let (sign, rest) = text.strip_prefix('-').map_or(("", text.as_str()), |r| ("-", r));
    let (int, frac) = rest.split_once('.').map_or((rest, None), |(i, f)| (i, Some(f)));
    let grouped: Vec<String> =
        int.as_bytes().rchunks(3).rev().map(|c| String::from_utf8_lossy(c).into_owned()).collect();
    format!("{sign}{}{}", grouped.join(","), frac.map_or(String::new(), |f| format!(".{f}")))
}

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_series_get_their_legend_under_the_panel() {
        let series = (0..10)
            .map(|i| Series { name: format!("s{i}"), color: "#000", points: vec![(1.0, i as f64)], dashed: i % 2 == 1 })
            .collect();
        let s = svg(&[Chart { title: "t".into(), series, ..Default::default() }]);
        assert!(!s.contains("fill-opacity"), "no legend box inside the panel");
        assert!(s.contains(&format!("height=\"{}\"", H + 16.0 * 5.0 + 8.0)), "five rows of two under it");
        assert!(s.contains(">s9</text>"));
    }

    #[test]
    fn stacked_bars_stack_from_zero() {
        let p = Bars {
            title: "memory".into(),
            y_label: "MB".into(),
            segments: vec![("kept".into(), "#1f77b4"), ("peak".into(), "#ff7f0e")],
            bars: vec![("DP".into(), vec![300.0, 100.0]), ("ZeRO-3".into(), vec![75.0, 25.0])],
        };
        let s = bars_svg(&[p]);
        assert_eq!(s.matches("<rect x=").count(), 2 * 2 + 1 + 2, "four segments, the frame, two legend keys");
        assert!(s.contains(">400</text>") && s.contains(">100</text>"), "each bar's total over it");
        assert!(s.contains(">ZeRO-3</text>") && s.contains(">0</text>"));
    }

    #[test]
    fn amounts_start_at_zero_and_events_are_named() {
        let c = Chart {
            title: "heap".into(),
            x_label: "event".into(),
            y_label: "MB".into(),
            series: vec![Series {
                name: "peak".into(),
                color: "#000",
                points: vec![(0.0, 50.0), (1.0, 60.0)],
                dashed: false,
            }],
            y_from_zero: true,
            x_names: vec![(0.5, "gather h.0".into()), (1.5, "free <it>".into())],
            ..Default::default()
        };
        let s = svg(&[c]);
        assert!(s.contains(">0</text>"), "a tick at zero: the axis starts there");
        assert!(s.contains("rotate(-60)\" text-anchor=\"end\" font-size=\"9\">gather h.0</text>"));
        assert!(s.contains("free &lt;it&gt;"));
        assert!(s.contains(&format!("height=\"{}\"", H + NAMES)), "room for the names");
    }

    #[test]
    fn two_panels_are_placed_side_by_side_and_deterministic() {
        let c = Chart {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![Series {
                name: "a & b".into(),
                color: "#1f77b4",
                points: vec![(1.0, 4.0), (2.0, 3.0)],
                dashed: false,
            }],
            ..Default::default()
        };
        let s = svg(&[c.clone(), c.clone()]);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("translate(520,0)"));
        assert!(s.contains("a &amp; b"));
        assert_eq!(s, svg(&[c.clone(), c]));
    }

    #[test]
    fn ticks_fall_on_round_values_and_read_plainly() {
        assert_eq!(nice_step(2_790.0), 5_000.0);
        assert_eq!(nice_step(0.23), 0.25);
        assert_eq!(nice_step(5e-7), 5e-7);
        assert_eq!(ticks(6_600.0, 18_200.0, 5_000.0), [10_000.0, 15_000.0]);
        assert_eq!(nice_step(2.3), 5.0, "not 2.5: its ticks would need a decimal");
        assert_eq!(label(15_000.0, 5_000.0, 18_000.0), "15,000");
        assert_eq!(label(1_234_567.0, 1.0, 2e6), "1,234,567");
        assert_eq!(label(3.5, 0.5, 4.0), "3.5");
        assert_eq!(label(0.25, 0.25, 1.0), "0.25");
        assert_eq!(label(0.3, 0.1, 1.0), "0.3");
        assert_eq!(label(-2.5, 0.25, 3.0), "-2.50");
        assert_eq!(label(-5e-7, 5e-7, 1e-6), "-5.0e-7");
        assert_eq!(label(2.7184, 1e-4, 2.72), "2.7184", "a flat series near 2.72: decimals, not 2.7e0");
        assert_eq!(label(1e-12, 0.5, 1.0), "0");
        assert!(ticks(f64::NEG_INFINITY, f64::INFINITY, 1.0).is_empty());
    }

    #[test]
    fn non_finite_values_are_left_out() {
        let c = Chart {
            title: "diverged".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![
                Series {
                    name: "a".into(),
                    color: "#000",
                    points: vec![(1.0, 4.0), (2.0, f64::INFINITY), (3.0, f64::NAN), (4.0, 3.0)],
                    dashed: false,
                },
                Series { name: "no finite point".into(), color: "#111", points: vec![(1.0, f64::NAN)], dashed: false },
            ],
            ..Default::default()
        };
        let s = svg(&[c]);
        assert!(s.contains("points=\"70.0,"), "the finite points are drawn");
        assert!(!s.contains("NaN") && !s.contains("inf"), "{s}");
    }

    #[test]
    fn whole_number_x_values_are_the_ticks_and_the_legend_avoids_the_lines() {
        // A line across the upper part of the panel: the legend must not sit on it.
        let c = Chart {
            title: "t".into(),
            x_label: "ranks".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "top".into(),
                color: "#000",
                points: vec![(1.0, 9.0), (2.0, 9.0), (4.0, 9.0)],
                dashed: false,
            }],
            y_range: Some((0.0, 10.0)),
            ..Default::default()
        };
        let s = svg(&[c]);
        for x in ["1", "2", "4"] {
            assert!(s.contains(&format!("text-anchor=\"middle\">{x}</text>")), "tick {x}");
        }
        assert!(!s.contains(">1.75<") && !s.contains(">3<"));
        let rect = s.lines().find(|l| l.starts_with("<rect x=") && l.contains("fill-opacity")).expect("legend box");
        let y: f64 = rect.split("y=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
        assert!(y > TOP + 100.0, "the legend moved down, off the line at the top: {rect}");
    }
}
