//! Plots of benchmark results (`--plot FILE.svg`), drawn with plotters' SVG backend.
//!
//! Two kinds: grouped bars ([`bars`]) and lines ([`lines`]). Each fits its axes to the data it
//! draws ([`Axis::fit`]): a log scale in whole decades where the values span orders of
//! magnitude, a linear one from zero otherwise; tick labels in readable units ([`Unit`]: k/M,
//! µs/ms/s, ×); the legend in a column right of the plot, never over the data. The layout (what
//! goes where, in the chart's coordinates) is computed by pure functions ([`bar_layout`],
//! [`line_layout`]) that the tests check: every drawn point inside the axes.

use anyhow::{anyhow, Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::ops::Range;
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
/// The whole picture, in pixels.
const SIZE: (u32, u32) = (1000, 540);
/// The legend's column, right of the plot.
const LEGEND_WIDTH: u32 = 200;
/// Positive values whose largest is this many times their smallest get a log scale.
pub const LOG_SPAN: f64 = 30.0;
/// Room above the largest value on a linear axis.
const HEADROOM: f64 = 1.1;

/// How tick labels and values read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// A count or a rate: 950, 1.5k, 70k, 2.3M.
    Count,
    /// A duration given in microseconds: 250 µs, 70 ms, 27 s.
    Micros,
    /// A ratio: 0.05×, 1×, 120×.
    Ratio,
}

impl Unit {
    /// `v` as a label.
    pub fn fmt(self, v: f64) -> String {
        match self {
            Unit::Count => {
                let a = v.abs();
                let (div, suffix) = if a >= 1e9 {
                    (1e9, "G")
                } else if a >= 1e6 {
                    (1e6, "M")
                } else if a >= 1e3 {
                    (1e3, "k")
                } else {
                    (1.0, "")
                };
                format!("{}{suffix}", short(v / div))
            }
            Unit::Micros => {
                let a = v.abs();
                if a >= 1e6 {
                    format!("{} s", short(v / 1e6))
                } else if a >= 1e3 {
                    format!("{} ms", short(v / 1e3))
                } else {
                    format!("{} µs", short(v))
                }
            }
            Unit::Ratio => format!("{}×", short(v)),
        }
    }
}

/// `v` with three significant digits (at most six decimals), without trailing zeros.
fn short(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v:.0}");
    }
    let digits = (2 - v.abs().log10().floor() as i64).clamp(0, 6) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// One axis: the values it shows, and whether on a log scale. Drawing happens in the chart's
/// coordinates ([`Axis::to_chart`]): the value on a linear axis, its log10 on a log one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Axis {
    /// The smallest value shown.
    pub lo: f64,
    /// The largest value shown.
    pub hi: f64,
    /// Log scale.
    pub log: bool,
}

impl Axis {
    /// The axis for `values` (non-finite ones ignored): a log scale from the decade below the
    /// smallest to the decade above the largest where all are positive and span [`LOG_SPAN`]
    /// or more (and `log_ok`), else linear from 0 (or the smallest, if negative) to the largest
    /// times `headroom`. A `headroom` of 1 means tight: a log scale then spans the values
    /// exactly too.
    pub fn fit(values: impl IntoIterator<Item = f64>, log_ok: bool, headroom: f64) -> Axis {
        let values: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if values.is_empty() {
            return Axis {
                lo: 0.0,
                hi: 1.0,
                log: false,
            };
        }
        if log_ok && min > 0.0 && max / min >= LOG_SPAN {
            let tight = headroom <= 1.0;
            return Axis {
                lo: if tight {
                    min
                } else {
                    10f64.powf(min.log10().floor())
                },
                hi: if tight {
                    max
                } else {
                    10f64.powf(max.log10().ceil())
                },
                log: true,
            };
        }
        let lo = min.min(0.0) * headroom;
        let hi = max.max(0.0) * headroom;
        Axis {
            lo,
            hi: if hi > lo { hi } else { lo + 1.0 },
            log: false,
        }
    }

    /// Where `v` is drawn; `None` where it cannot be (not finite, or not positive on a log
    /// scale).
    pub fn to_chart(self, v: f64) -> Option<f64> {
        match (v.is_finite(), self.log) {
            (false, _) => None,
            (true, false) => Some(v),
            (true, true) => (v > 0.0).then(|| v.log10()),
        }
    }

    /// The axis' extent in the chart's coordinates.
    pub fn range(&self) -> Range<f64> {
        if self.log {
            self.lo.log10()..self.hi.log10()
        } else {
            self.lo..self.hi
        }
    }

    /// Whether a chart coordinate lies on the axis (with a rounding's tolerance).
    #[cfg(test)]
    fn contains(&self, c: f64) -> bool {
        let r = self.range();
        let eps = (r.end - r.start).abs() * 1e-9;
        c.is_finite() && c >= r.start - eps && c <= r.end + eps
    }

    /// The label of a chart coordinate.
    fn label(&self, c: f64, unit: Unit) -> String {
        unit.fmt(if self.log { 10f64.powf(c) } else { c })
    }

    /// How many tick labels: one a decade on a log scale (so the ticks land on whole decades).
    fn ticks(&self) -> usize {
        if self.log {
            let r = self.range();
            ((r.end.floor() - r.start.ceil()) as usize + 1).max(3)
        } else {
            10
        }
    }

    /// An axis description, saying when the scale is log.
    fn desc(&self, desc: &str) -> String {
        if self.log {
            format!("{desc} (log scale)")
        } else {
            desc.to_string()
        }
    }
}

/// Grouped bars to draw: groups along x (labelled), one bar per series in each.
pub struct Bars<'a> {
    /// The caption.
    pub title: &'a str,
    /// What y is.
    pub y_desc: &'a str,
    /// How y reads.
    pub unit: Unit,
    /// The series' names, one colour each.
    pub series: &'a [String],
    /// Each group's label and its value per series (`None`: not measured).
    pub groups: &'a [(String, Vec<Option<f64>>)],
    /// Where bars start: `None` for the axis' bottom (0 on a linear scale); `Some(1.0)` for
    /// ratios, so a bar goes up for more and down for less, with a line across.
    pub base: Option<f64>,
}

/// One bar in chart coordinates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bar {
    /// Its series.
    pub series: usize,
    /// Left and right (groups are 1 wide, group g from g to g + 1).
    pub x: (f64, f64),
    /// Bottom and top (either way round).
    pub y: (f64, f64),
    /// The value it shows.
    pub value: f64,
}

/// Where grouped bars go.
#[derive(Debug)]
pub struct BarLayout {
    /// 0 to the number of groups.
    pub x: Axis,
    /// The values (and the base).
    pub y: Axis,
    /// Where bars start, in chart coordinates.
    pub base: f64,
    /// The bars.
    pub bars: Vec<Bar>,
}

/// Lays grouped bars out.
pub fn bar_layout(b: &Bars<'_>) -> BarLayout {
    let values = || {
        b.groups
            .iter()
            .flat_map(|(_, v)| v.iter().flatten().copied())
    };
    let y = Axis::fit(values().chain(b.base), true, HEADROOM);
    let base =
        b.base
            .and_then(|v| y.to_chart(v))
            .unwrap_or(if y.log { y.range().start } else { 0.0 });
    let n = b.series.len().max(1) as f64;
    let mut bars = Vec::new();
    for (g, (_, values)) in b.groups.iter().enumerate() {
        for (s, v) in values.iter().enumerate().take(b.series.len()) {
            let Some((value, top)) = v.and_then(|v| Some((v, y.to_chart(v)?))) else {
                continue;
            };
            let x0 = g as f64 + 0.1 + 0.8 * s as f64 / n;
            bars.push(Bar {
                series: s,
                x: (x0, x0 + 0.8 / n),
                y: (base, top),
                value,
            });
        }
    }
    BarLayout {
        x: Axis {
            lo: 0.0,
            hi: b.groups.len().max(1) as f64,
            log: false,
        },
        y,
        base,
        bars,
    }
}

/// Lines to draw.
pub struct Lines<'a> {
    /// The caption.
    pub title: &'a str,
    /// What x is, and how it reads.
    pub x_desc: &'a str,
    /// How x reads.
    pub x_unit: Unit,
    /// What y is.
    pub y_desc: &'a str,
    /// How y reads.
    pub y_unit: Unit,
    /// Each series' name and (x, y) points.
    pub series: &'a [(String, Vec<(f64, f64)>)],
    /// Vertical markers: where (x), and a label drawn at the top.
    pub marks: &'a [(f64, String)],
    /// What the markers are, for the legend.
    pub marks_desc: &'a str,
}

/// Where lines go.
#[derive(Debug)]
pub struct LineLayout {
    /// The points' and markers' x.
    pub x: Axis,
    /// The points' y.
    pub y: Axis,
    /// Each series' points, in chart coordinates (points that cannot be drawn left out).
    pub series: Vec<Vec<(f64, f64)>>,
    /// The markers that can be drawn: their index in [`Lines::marks`] and x in chart
    /// coordinates.
    pub marks: Vec<(usize, f64)>,
}

/// Lays lines out: x from the smallest to the largest point (so the runs fill the width), y
/// fitted to the points.
pub fn line_layout(l: &Lines<'_>) -> LineLayout {
    let points = || l.series.iter().flat_map(|(_, p)| p.iter().copied());
    let x = Axis::fit(
        points().map(|p| p.0).chain(l.marks.iter().map(|m| m.0)),
        true,
        1.0,
    );
    let y = Axis::fit(points().map(|p| p.1), true, HEADROOM);
    let series = l
        .series
        .iter()
        .map(|(_, pts)| {
            pts.iter()
                .filter_map(|&(px, py)| Some((x.to_chart(px)?, y.to_chart(py)?)))
                .collect()
        })
        .collect();
    let marks = l
        .marks
        .iter()
        .enumerate()
        .filter_map(|(i, m)| Some((i, x.to_chart(m.0)?)))
        .collect();
    LineLayout {
        x,
        y,
        series,
        marks,
    }
}

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

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// How a legend entry is drawn.
enum Swatch {
    Box(RGBColor),
    Line(RGBColor),
    Dashed,
}

/// A white picture with the caption on top; the plot's area and the legend's column (none
/// wide without a legend).
fn canvas<'a>(path: &'a Path, title: &str, legend: bool) -> Result<(Area<'a>, Area<'a>)> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(err)?;
    Ok(root.split_horizontally(SIZE.0 - if legend { LEGEND_WIDTH } else { 0 }))
}

/// The legend, in its own column; then the picture is written (once: the SVG backend writes
/// what was drawn when first presented).
fn legend(area: &Area<'_>, entries: &[(String, Swatch)]) -> Result<()> {
    let style = ("sans-serif", 14).into_font().color(&BLACK);
    for (i, (label, swatch)) in entries.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        match swatch {
            Swatch::Box(c) => area.draw(&Rectangle::new([(8, y - 6), (22, y + 6)], c.filled())),
            Swatch::Line(c) => area.draw(&PathElement::new([(4, y), (26, y)], c.stroke_width(3))),
            Swatch::Dashed => {
                for x in [4, 12, 20] {
                    area.draw(&PathElement::new(
                        [(x, y), (x + 5, y)],
                        BLACK.mix(0.5).stroke_width(2),
                    ))
                    .map_err(err)?;
                }
                Ok(())
            }
        }
        .map_err(err)?;
        area.draw(&Text::new(label.clone(), (32, y - 7), style.clone()))
            .map_err(err)?;
    }
    area.present().map_err(err)
}

fn chart<'a, 'b>(area: &'a Area<'b>, x: &Axis, y: &Axis) -> Result<Chart<'a, 'b>> {
    ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(x.range(), y.range())
        .map_err(err)
}

/// Draws grouped bars into `path`.
pub fn bars(path: &Path, b: &Bars<'_>) -> Result<()> {
    svg_path(path)?;
    let layout = bar_layout(b);
    let (area, side) = canvas(path, b.title, b.series.len() > 1)?;
    let mut chart = chart(&area, &layout.x, &layout.y)?;
    let labels: Vec<String> = b.groups.iter().map(|(l, _)| l.clone()).collect();
    let y = layout.y;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(b.groups.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-9 && i < labels.len() {
                labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_labels(y.ticks())
        .y_label_formatter(&|c| y.label(*c, b.unit))
        .y_desc(y.desc(b.y_desc))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(layout.bars.iter().map(|bar| {
            let color = PALETTE[bar.series % PALETTE.len()];
            Rectangle::new([(bar.x.0, bar.y.0), (bar.x.1, bar.y.1)], color.filled())
        }))
        .map_err(err)?;
    // The top edge, thick: a bar as tall as the base (the reference itself) still shows.
    chart
        .draw_series(layout.bars.iter().map(|bar| {
            let color = PALETTE[bar.series % PALETTE.len()];
            PathElement::new(
                [(bar.x.0, bar.y.1), (bar.x.1, bar.y.1)],
                color.stroke_width(3),
            )
        }))
        .map_err(err)?;
    if b.series.len() == 1 {
        // One bar a group: its value over it.
        let font = ("sans-serif", 13)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart
            .draw_series(layout.bars.iter().map(|bar| {
                EmptyElement::at(((bar.x.0 + bar.x.1) / 2.0, bar.y.1))
                    + Text::new(b.unit.fmt(bar.value), (0, -3), font.clone())
            }))
            .map_err(err)?;
    }
    if b.base.is_some() {
        chart
            .draw_series(LineSeries::new(
                [(layout.x.lo, layout.base), (layout.x.hi, layout.base)],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?;
    }
    let entries: Vec<(String, Swatch)> = if b.series.len() > 1 {
        b.series
            .iter()
            .enumerate()
            .map(|(s, name)| (name.clone(), Swatch::Box(PALETTE[s % PALETTE.len()])))
            .collect()
    } else {
        Vec::new()
    };
    legend(&side, &entries).with_context(|| format!("write {}", path.display()))
}

/// Draws lines into `path`, with dashed vertical markers labelled at the top.
pub fn lines(path: &Path, l: &Lines<'_>) -> Result<()> {
    svg_path(path)?;
    let layout = line_layout(l);
    let (area, side) = canvas(path, l.title, true)?;
    let mut chart = chart(&area, &layout.x, &layout.y)?;
    let (x, y) = (layout.x, layout.y);
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(x.ticks())
        .x_label_formatter(&|c| x.label(*c, l.x_unit))
        .y_labels(y.ticks())
        .y_label_formatter(&|c| y.label(*c, l.y_unit))
        .x_desc(x.desc(l.x_desc))
        .y_desc(y.desc(l.y_desc))
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    let yr = y.range();
    let font = ("sans-serif", 12).into_font().color(&BLACK.mix(0.8));
    for (row, &(i, mx)) in layout.marks.iter().enumerate() {
        let label = &l.marks[i].1;
        chart
            .draw_series(DashedLineSeries::new(
                [(mx, yr.start), (mx, yr.end)],
                5,
                4,
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(err)?;
        // Labels on two rows, so neighbours do not overlap.
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((mx, yr.end))
                    + Text::new(label.clone(), (3, 4 + 14 * (row as i32 % 2)), font.clone()),
            ))
            .map_err(err)?;
    }
    for (s, pts) in layout.series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?;
        if pts.len() < 3 {
            // A line of one point draws nothing: mark the points.
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(err)?;
        }
    }
    let mut entries: Vec<(String, Swatch)> = l
        .series
        .iter()
        .enumerate()
        .map(|(s, (name, _))| (name.clone(), Swatch::Line(PALETTE[s % PALETTE.len()])))
        .collect();
    if !l.marks.is_empty() {
        entries.push((l.marks_desc.to_string(), Swatch::Dashed));
    }
    legend(&side, &entries).with_context(|| format!("write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_bars_inside(layout: &BarLayout) {
        for bar in &layout.bars {
            for x in [bar.x.0, bar.x.1] {
                assert!(layout.x.contains(x), "{bar:?} outside x {:?}", layout.x);
            }
            for y in [bar.y.0, bar.y.1] {
                assert!(layout.y.contains(y), "{bar:?} outside y {:?}", layout.y);
            }
        }
    }

    fn assert_lines_inside(layout: &LineLayout, expected: &[(String, Vec<(f64, f64)>)]) {
        for ((name, given), drawn) in expected.iter().zip(&layout.series) {
            assert_eq!(drawn.len(), given.len(), "{name}: every point drawn");
            for &(x, y) in drawn {
                assert!(layout.x.contains(x), "{name}: x {x} outside {:?}", layout.x);
                assert!(layout.y.contains(y), "{name}: y {y} outside {:?}", layout.y);
            }
        }
        for &(_, m) in &layout.marks {
            assert!(layout.x.contains(m), "mark {m} outside {:?}", layout.x);
        }
    }

    /// A run of `records` records in `seconds`, as points (records written, records/s).
    fn run(records: f64, rate: f64, points: usize) -> Vec<(f64, f64)> {
        (1..=points)
            .map(|i| {
                (
                    records * i as f64 / points as f64,
                    rate * (1.0 + 0.1 * (i % 3) as f64),
                )
            })
            .collect()
    }

    #[test]
    fn units_read_as_people_write_them() {
        assert_eq!(Unit::Count.fmt(70000.0), "70k");
        assert_eq!(Unit::Count.fmt(1_500_000.0), "1.5M");
        assert_eq!(Unit::Count.fmt(950.0), "950");
        assert_eq!(Unit::Count.fmt(0.0), "0");
        assert_eq!(Unit::Count.fmt(12_500.0), "12.5k");
        assert_eq!(Unit::Micros.fmt(70000.0), "70 ms");
        assert_eq!(Unit::Micros.fmt(250.0), "250 µs");
        assert_eq!(Unit::Micros.fmt(27_300_000.0), "27.3 s");
        assert_eq!(Unit::Ratio.fmt(0.05), "0.05×");
        assert_eq!(Unit::Ratio.fmt(1.0), "1×");
        assert_eq!(Unit::Ratio.fmt(120.0), "120×");
    }

    #[test]
    fn axes_go_log_only_across_orders_of_magnitude() {
        let a = Axis::fit([2.0, 5.0, 9.0], true, 1.1);
        assert!(!a.log && a.lo == 0.0 && a.hi > 9.0);
        let a = Axis::fit([7_000.0, 2_000_000.0], true, 1.1);
        assert!(a.log);
        assert_eq!((a.lo, a.hi), (1_000.0, 10_000_000.0));
        assert!(
            !Axis::fit([0.0, 1e6], true, 1.1).log,
            "a zero cannot go on a log scale"
        );
        assert!(!Axis::fit([1.0, 1e6], false, 1.1).log);
        assert_eq!(Axis::fit([], true, 1.1).range(), 0.0..1.0);
        assert_eq!(Axis::fit([0.0], true, 1.1).range(), 0.0..1.0);
    }

    #[test]
    fn lines_of_runs_100_times_apart_all_fill_the_axes() {
        // Like io500-hard: citron's 200,000 records at ~1M/s, mutex's at ~7k/s, seg's at 3M/s,
        // on a records-written x axis; scale-ups marked where they happened.
        let series = vec![
            ("citron".to_string(), run(200_000.0, 943_000.0, 60)),
            ("mutex".to_string(), run(200_000.0, 7_200.0, 60)),
            ("seg".to_string(), run(200_000.0, 3_041_000.0, 60)),
        ];
        let marks: Vec<(f64, String)> = [22.0, 89.0, 357.0, 91_000.0]
            .iter()
            .map(|&x| (x, "1 ms".to_string()))
            .collect();
        let l = Lines {
            title: "t",
            x_desc: "records written",
            x_unit: Unit::Count,
            y_desc: "locks/s",
            y_unit: Unit::Count,
            series: &series,
            marks: &marks,
            marks_desc: "scale-up",
        };
        let layout = line_layout(&l);
        assert!(layout.y.log, "rates 400× apart: {:?}", layout.y);
        assert!(
            layout.x.log,
            "marks from 22 to 200k records: {:?}",
            layout.x
        );
        assert_lines_inside(&layout, &series);
        // Each run spans the same width: the last point of every series at the right edge.
        for s in &layout.series {
            assert!((s.last().unwrap().0 - layout.x.range().end).abs() < 1e-9);
        }
    }

    #[test]
    fn lines_of_a_short_run_are_drawn_inside() {
        // 50,000 records, one point for the fast scheme: still inside, still drawn.
        let series = vec![
            ("citron".to_string(), vec![(50_000.0, 1_200_000.0)]),
            ("mutex".to_string(), run(50_000.0, 7_000.0, 30)),
        ];
        let l = Lines {
            title: "t",
            x_desc: "records written",
            x_unit: Unit::Count,
            y_desc: "locks/s",
            y_unit: Unit::Count,
            series: &series,
            marks: &[],
            marks_desc: "",
        };
        assert_lines_inside(&line_layout(&l), &series);
    }

    #[test]
    fn ratio_bars_stand_on_one_and_stay_inside() {
        // Like compare: every file system over the best peer; tmpfs 200× it, citronfs-tcp
        // below it.
        let series: Vec<String> = ["citronfs-shm", "citronfs-tcp", "tmpfs", "peer"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let groups = vec![
            (
                "create".to_string(),
                vec![Some(1.42), Some(0.55), Some(212.0), Some(1.0)],
            ),
            (
                "btio".to_string(),
                vec![Some(8.8), Some(1.01), Some(47.0), None],
            ),
        ];
        let b = Bars {
            title: "t",
            y_desc: "÷ best peer",
            unit: Unit::Ratio,
            series: &series,
            groups: &groups,
            base: Some(1.0),
        };
        let layout = bar_layout(&b);
        assert!(layout.y.log);
        assert_eq!(layout.base, 0.0, "log10(1)");
        assert_eq!(layout.bars.len(), 7);
        assert_bars_inside(&layout);
        // A bar below 1 goes down from the base.
        assert!(layout.bars[1].y.1 < layout.base);
    }

    #[test]
    fn linear_bars_stay_inside() {
        let series = vec!["reader p99".to_string(), "writer p99".to_string()];
        let groups = vec![
            ("citron".to_string(), vec![Some(61_178.0), Some(61_276.0)]),
            ("mutex".to_string(), vec![Some(68_878.0), Some(69_009.0)]),
        ];
        let b = Bars {
            title: "t",
            y_desc: "p99",
            unit: Unit::Micros,
            series: &series,
            groups: &groups,
            base: None,
        };
        let layout = bar_layout(&b);
        assert!(!layout.y.log);
        assert_bars_inside(&layout);
    }

    #[test]
    fn plots_are_svg_files_with_their_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.svg");
        let series = vec!["citron".to_string(), "mutex".to_string()];
        let groups = vec![
            ("A".to_string(), vec![Some(3.0), Some(1.0)]),
            ("B".to_string(), vec![Some(2.0), None]),
        ];
        let b = Bars {
            title: "btio",
            y_desc: "MiB/s",
            unit: Unit::Count,
            series: &series,
            groups: &groups,
            base: None,
        };
        bars(&path, &b).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("citron") && svg.contains("mutex"));
        let path = dir.path().join("line.svg");
        let series = vec![("citron".to_string(), vec![(1.0, 1.0), (100.0, 3.0)])];
        let marks = vec![(50.0, "37 ms".to_string())];
        let l = Lines {
            title: "io500-hard",
            x_desc: "records written",
            x_unit: Unit::Count,
            y_desc: "locks/s",
            y_unit: Unit::Count,
            series: &series,
            marks: &marks,
            marks_desc: "scale-up",
        };
        lines(&path, &l).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("io500-hard") && svg.contains("37 ms") && svg.contains("scale-up"));
        assert!(bars(&dir.path().join("x.png"), &b).is_err());
    }
}
