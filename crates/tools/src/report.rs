//! Printing benchmark results: an aligned table for people, one JSON object per line for tools.

use serde::Serialize;

/// Collects rows of one kind and prints them as a table or as JSON lines.
pub struct Report {
    json: bool,
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Report {
    /// A report with these column titles; `json` selects JSON lines instead of a table.
    pub fn new(json: bool, header: &[&'static str]) -> Self {
        Self {
            json,
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds one result: `cells` for the table, `record` for JSON. JSON lines are printed at once,
    /// so a long run streams its results.
    pub fn add(&mut self, cells: Vec<String>, record: &impl Serialize) {
        if self.json {
            println!(
                "{}",
                serde_json::to_string(record).expect("results serialize")
            );
        } else {
            debug_assert_eq!(cells.len(), self.header.len());
            self.rows.push(cells);
        }
    }

    /// Prints the table (nothing more in JSON mode).
    pub fn finish(self) {
        if self.json {
            return;
        }
        print!("{}", self.table());
    }

    /// The table as text, one line per row after the header and its rule (whatever the mode).
    pub fn table(&self) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r[c].len())
                    .chain([self.header[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[&str]| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (cell, w))| {
                    if i == 0 {
                        format!("{cell:<w$}")
                    } else {
                        format!("{cell:>w$}")
                    }
                })
                .collect();
            format!("{}\n", parts.join("  "))
        };
        let mut out = line(&self.header);
        let rules: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        out += &line(&rules.iter().map(String::as_str).collect::<Vec<_>>());
        for row in &self.rows {
            out += &line(&row.iter().map(String::as_str).collect::<Vec<_>>());
        }
        out
    }
}

/// Formats a float with `digits` decimals.
pub fn fmt_f(value: f64, digits: usize) -> String {
    format!("{value:.digits$}")
}

/// `value` with `digits` decimals, or `-` where a row has none (a column that does not apply,
/// or was not measured).
pub fn fmt_opt(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".into(), |x| fmt_f(x, digits))
}

/// `value` over `reference`, when a reference was measured and is positive.
pub fn ratio(value: f64, reference: Option<f64>) -> Option<f64> {
    reference.filter(|&r| r > 0.0).map(|r| value / r)
}

/// A ratio as the tables show it: three decimals, `-` for none.
pub fn fmt_ratio(ratio: Option<f64>) -> String {
    fmt_opt(ratio, 3)
}
