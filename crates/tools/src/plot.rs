//! Plots of benchmark results (`--plot FILE.svg`), drawn with plotters' SVG backend.

use anyhow::{anyhow, Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::path::Path;

/// Colours of the series, in order.
const PALETTE: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

fn svg_path(path: &Path) -> Result<()> {
    anyhow::ensure!(
        path.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("svg")),
        "--plot {}: plots are SVG; name the file *.svg",
        path.display()
    );
    Ok(())
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("plot: {e}")
}

/// The charts here: f64 against f64, drawn on SVG.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws the legend and writes the file.
fn finish<'a>(
    chart: &mut Chart<'a, 'a>,
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    path: &Path,
) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present()
        .with_context(|| format!("write {}", path.display()))
}

/// Groups of bars: one group per `groups` entry (its label, then one value per series), one
/// colour per series name.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_desc: &str,
    series: &[String],
    groups: &[(String, Vec<Option<f64>>)],
) -> Result<()> {
    svg_path(path)?;
    let top = groups
        .iter()
        .flat_map(|(_, v)| v.iter().flatten())
        .fold(0f64, |m, &v| m.max(v))
        .max(f64::MIN_POSITIVE)
        * 1.1;
    let n = series.len().max(1) as f64;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..groups.len() as f64, 0f64..top)
        .map_err(err)?;
    let labels: Vec<String> = groups.iter().map(|(l, _)| l.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-9 && i < labels.len() {
                labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for (s, name) in series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        let bars = groups.iter().enumerate().filter_map(|(g, (_, values))| {
            let v = values.get(s).copied().flatten()?;
            let x0 = g as f64 + 0.1 + 0.8 * s as f64 / n;
            let x1 = x0 + 0.8 / n;
            Some(Rectangle::new([(x0, 0.0), (x1, v)], color.filled()))
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    finish(&mut chart, &root, path)
}

/// Lines over time: `series` of (x, y) points, and vertical markers at `marks` (x values).
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    marks: &[f64],
) -> Result<()> {
    svg_path(path)?;
    let points = || series.iter().flat_map(|(_, p)| p.iter());
    let x_max = points().fold(0f64, |m, p| m.max(p.0)).max(1e-9);
    let y_max = points()
        .fold(0f64, |m, p| m.max(p.1))
        .max(f64::MIN_POSITIVE)
        * 1.1;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for &x in marks {
        chart
            .draw_series(LineSeries::new(
                [(x, 0.0), (x, y_max)],
                BLACK.mix(0.4).stroke_width(1),
            ))
            .map_err(err)?;
    }
    for (s, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    finish(&mut chart, &root, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_files_with_their_labels() {
        let dir = tempfile::tempdir().unwrap();
        let bars = dir.path().join("bars.svg");
        grouped_bars(
            &bars,
            "btio",
            "MiB/s",
            &["citron".into(), "mutex".into()],
            &[
                ("A".into(), vec![Some(3.0), Some(1.0)]),
                ("B".into(), vec![Some(2.0), None]),
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&bars).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("citron") && svg.contains("mutex"));
        let line = dir.path().join("line.svg");
        lines(
            &line,
            "io500-hard",
            "ms",
            "locks/s",
            &[("citron".into(), vec![(0.0, 1.0), (100.0, 3.0)])],
            &[50.0],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&line)
            .unwrap()
            .contains("io500-hard"));
        assert!(grouped_bars(&dir.path().join("x.png"), "t", "y", &[], &[]).is_err());
    }
}
