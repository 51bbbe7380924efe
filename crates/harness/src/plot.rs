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
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Fixed y range; by default the data's range with a margin.
    pub y_range: Option<(f64, f64)>,
}

const W: f64 = 520.0;
const H: f64 = 340.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// Lays the charts out side by side in one SVG document.
pub fn svg(charts: &[Chart]) -> String {
    let width = W * charts.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{H}\" viewBox=\"0 0 {width} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, c) in charts.iter().enumerate() {
        s.push_str(&format!("<g transform=\"translate({},0)\">\n", i as f64 * W));
        s.push_str(&c.render());
        s.push_str("</g>\n");
    }
    s.push_str("</svg>\n");
    s
}

impl Chart {
    fn render(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
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
        let (y0, y1) = match self.y_range {
            Some(r) => r,
            None if y1 == y0 => (y0 - 1.0, y1 + 1.0),
            None => (y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)),
        };
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;
        let mut s = String::new();
        s.push_str(&format!("<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">{}</text>\n", W / 2.0, esc(&self.title)));
        s.push_str(&format!("<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n"));
        for i in 0..=4 {
            let f = i as f64 / 4.0;
            let (xv, yv) = (x0 + f * (x1 - x0), y0 + f * (y1 - y0));
            s.push_str(&format!("<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\n", LEFT + pw, sy(yv), sy(yv)));
            s.push_str(&format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n", LEFT - 6.0, sy(yv) + 4.0, tick(yv)));
            // Whole steps on a long axis: "13", not "13.25".
            let xv = if x1 - x0 >= 8.0 { xv.round() } else { xv };
            s.push_str(&format!("<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", sx(xv), TOP + ph + 16.0, tick(xv)));
        }
        s.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", LEFT + pw / 2.0, H - 10.0, esc(&self.x_label)));
        s.push_str(&format!(
            "<text transform=\"translate(16,{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            TOP + ph / 2.0,
            esc(&self.y_label)
        ));
        for (i, ser) in self.series.iter().enumerate() {
            let path: Vec<String> = ser.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y.clamp(y0, y1)))).collect();
            let dash = if ser.dashed { " stroke-dasharray=\"6 4\"" } else { "" };
            s.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
                ser.color,
                path.join(" ")
            ));
            let ly = TOP + 16.0 + 16.0 * i as f64;
            s.push_str(&format!("<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\n", LEFT + pw - 150.0, LEFT + pw - 126.0, ser.color));
            s.push_str(&format!("<text x=\"{}\" y=\"{}\">{}</text>\n", LEFT + pw - 120.0, ly + 4.0, esc(&ser.name)));
        }
        s
    }
}

fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.abs() < 0.01 {
        format!("{v:.1e}")
    } else {
        format!("{}", (v * 100.0).round() / 100.0)
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_panels_are_placed_side_by_side_and_deterministic() {
        let c = Chart {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![Series { name: "a & b".into(), color: "#1f77b4", points: vec![(1.0, 4.0), (2.0, 3.0)], dashed: false }],
            y_range: None,
        };
        let s = svg(&[c.clone(), c.clone()]);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("translate(520,0)"));
        assert!(s.contains("a &amp; b"));
        assert_eq!(s, svg(&[c.clone(), c]));
    }
}

