//! The demo's loss curve as a PNG, with the faults marked on it.

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::Once;

/// A fault to mark: the step it hit and a short label.
#[derive(Debug, Clone)]
pub struct Mark {
    pub step: u64,
    pub label: String,
}

/// One loss series: its label and `(step, loss)` points.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(u64, f64)>,
}

const FONT: &str = "sans-serif";

/// The embedded DejaVu Sans, so the chart needs no system fonts.
fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| anyhow!("the embedded font does not parse"));
    });
    result
}

/// Draws the series (the first solid, the others dashed over it), the
/// entropy floor, and a labelled vertical line at every mark.
pub fn loss_curve(
    path: &Path,
    title: &str,
    series: &[Series],
    floor: f64,
    marks: &[Mark],
) -> Result<()> {
    register_font()?;
    let draw = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let steps = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .max()
            .unwrap_or(1)
            .max(1);
        let (lo, hi) = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .filter(|l| l.is_finite())
            .fold((floor, floor), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let pad = (hi - lo).max(1e-3) * 0.05;
        let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 26))
            .margin(20)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0u64..steps, (lo - pad)..(hi + pad))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss (nats/token)")
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 18))
            .draw()?;
        let colors = [BLUE, RGBColor(230, 120, 0), GREEN];
        for (i, s) in series.iter().enumerate() {
            let color = colors[i % colors.len()];
            let style = color.stroke_width(if i == 0 { 3 } else { 2 });
            let pts = s.points.iter().copied();
            if i == 0 {
                chart
                    .draw_series(LineSeries::new(pts, style))?
                    .label(&s.label)
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
            } else {
                chart
                    .draw_series(DashedLineSeries::new(pts, 8, 6, style))?
                    .label(&s.label)
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
            }
        }
        let grey = RGBColor(110, 110, 110);
        chart
            .draw_series(DashedLineSeries::new(
                [(0, floor), (steps, floor)],
                4,
                4,
                grey.stroke_width(1),
            ))?
            .label(format!("entropy floor {floor:.3}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], grey));
        let red = RGBColor(200, 30, 30);
        for (i, m) in marks.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                [(m.step, lo - pad), (m.step, hi + pad)],
                red.stroke_width(1),
            ))?;
            // Labels step down the chart so neighbours do not overlap, and
            // sit left of their line in the last quarter.
            let y = hi + pad - (hi - lo + 2.0 * pad) * (0.04 + 0.06 * (i % 6) as f64);
            let right = m.step * 4 > steps * 3;
            let anchor = if right { HPos::Right } else { HPos::Left };
            chart.draw_series(std::iter::once(Text::new(
                format!(" {} ", m.label),
                (m.step, y),
                (FONT, 15)
                    .into_font()
                    .color(&red)
                    .pos(Pos::new(anchor, VPos::Top)),
            )))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("cannot draw the loss curve into {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_with_marks() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("loss.png");
        let curve: Vec<(u64, f64)> = (1..=50)
            .map(|s| (s, 4.0 / (1.0 + s as f64 / 10.0)))
            .collect();
        let series = [
            Series {
                label: "without faults".into(),
                points: curve.clone(),
            },
            Series {
                label: "with faults".into(),
                points: curve,
            },
        ];
        let marks = [Mark {
            step: 20,
            label: "SIGKILL rank 1".into(),
        }];
        loss_curve(&path, "loss", &series, 1.0, &marks).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
    }
}
