//! The PNG chart: goodput against cluster size for each policy, with the
//! published points marked.

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// One policy's line: `(accelerators, median, p10, p90)`.
#[derive(Debug, Clone)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64, f64, f64)>,
}

/// A published figure: accelerators (`None`: size not published) and
/// goodput.
#[derive(Debug, Clone, Copy)]
pub struct Published {
    pub label: &'static str,
    pub accelerators: Option<f64>,
    pub goodput: f64,
}

/// Llama 3 (more than 90% on 16,384 H100), ByteRobust (97% on 9,600
/// GPUs), Gemini (97% once recovering from in-memory replicas; the size is
/// not published).
pub const PUBLISHED: [Published; 3] = [
    Published {
        label: "Llama 3: >90%, 16,384 H100",
        accelerators: Some(16_384.0),
        goodput: 0.90,
    },
    Published {
        label: "ByteRobust: 97%, 9,600 GPUs",
        accelerators: Some(9_600.0),
        goodput: 0.97,
    },
    Published {
        label: "Gemini with in-memory replicas: 97% (size not published)",
        accelerators: None,
        goodput: 0.97,
    },
];

const FONT: &str = "sans-serif";

fn register_font() -> Result<()> {
    static FONT_READY: OnceLock<bool> = OnceLock::new();
    let ok = *FONT_READY.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded font does not parse"))
    }
}

/// Draws the lines (median, with the 10–90% band as whiskers) on a log
/// axis of accelerators.
pub fn goodput_by_size(path: &Path, title: &str, lines: &[Line]) -> Result<()> {
    register_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let (lo, hi) = xs.fold((f64::MAX, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
        let (lo, hi) = (lo.min(9_600.0) / 1.3, hi.max(16_384.0) * 1.3);
        let ymin = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.2))
            .fold(0.85f64, f64::min)
            .max(0.0);
        let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 24))
            .margin(20)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d((lo..hi).log_scale(), (ymin - 0.01)..1.005)?;
        chart
            .configure_mesh()
            .x_desc("accelerators")
            .y_desc("goodput (share of time on kept steps)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
        let colors = [
            RGBColor(200, 30, 30),
            RGBColor(230, 120, 0),
            RGBColor(20, 90, 200),
            RGBColor(20, 150, 60),
        ];
        for (i, l) in lines.iter().enumerate() {
            let c = colors[i % colors.len()];
            let style = c.stroke_width(3);
            chart
                .draw_series(LineSeries::new(l.points.iter().map(|p| (p.0, p.1)), style))?
                .label(&l.label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
            for p in &l.points {
                chart.draw_series(std::iter::once(PathElement::new(
                    [(p.0, p.2), (p.0, p.3)],
                    c.stroke_width(1),
                )))?;
                chart.draw_series(std::iter::once(Circle::new((p.0, p.1), 3, c.filled())))?;
            }
        }
        let black = RGBColor(0, 0, 0);
        for p in PUBLISHED {
            match p.accelerators {
                Some(x) => {
                    chart
                        .draw_series(std::iter::once(TriangleMarker::new(
                            (x, p.goodput),
                            9,
                            black.filled(),
                        )))?
                        .label(p.label)
                        .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, black.filled()));
                }
                None => {
                    let grey = RGBColor(90, 90, 90);
                    chart
                        .draw_series(DashedLineSeries::new(
                            [(lo, p.goodput), (hi, p.goodput)],
                            6,
                            6,
                            grey.stroke_width(1),
                        ))?
                        .label(p.label)
                        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], grey));
                }
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .label_font((FONT, 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("cannot draw the chart into {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("g.png");
        let lines = [Line {
            label: "x".into(),
            points: vec![(1024.0, 0.99, 0.98, 0.995), (16_384.0, 0.95, 0.94, 0.96)],
        }];
        goodput_by_size(&path, "t", &lines).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }
}
