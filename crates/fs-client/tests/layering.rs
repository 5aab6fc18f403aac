//! The crate's layering, checked from its source: `Inner` is extended only in `client.rs`,
//! and no import circle among the library's modules spans more than two files (each module
//! uses those below it; see the crate docs).
//!
//! A module's imports are the `crate::<module>` paths its code names (comments and its
//! `#[cfg(test)]` part left out), `lib.rs` being the root that declares them all.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// The library's source files by module name (`lib.rs` left out), with their code: comments
/// and the `#[cfg(test)]` part cut.
fn modules() -> BTreeMap<String, String> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a source file is readable");
        let code = match text.find("#[cfg(test)]") {
            Some(at) => &text[..at],
            None => &text[..],
        };
        let code: String = code
            .lines()
            .map(|line| match line.find("//") {
                Some(at) => &line[..at],
                None => line,
            })
            .collect::<Vec<_>>()
            .join("\n");
        modules.insert(module.to_string(), code);
    }
    modules
}

/// The modules each module names: `crate::m` anywhere, or `m::` inside a `use crate::{...}`.
fn imports(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let named = |text: &str, after: &str| -> BTreeSet<String> {
        text.split(after)
            .skip(1)
            .map(|rest| {
                rest.chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect::<String>()
            })
            .collect()
    };
    modules
        .iter()
        .map(|(module, code)| {
            let mut deps = named(code, "crate::");
            for group in code.split("use crate::{").skip(1) {
                let group = group.split('}').next().unwrap_or("");
                for part in group.split(',') {
                    if let Some((first, _)) = part.trim().split_once("::") {
                        deps.insert(first.to_string());
                    }
                }
            }
            deps.retain(|d| d != module && modules.contains_key(d));
            (module.clone(), deps)
        })
        .collect()
}

/// The strongly connected components of `graph` (Tarjan's algorithm).
fn components(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<Vec<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                self.found.push(component);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn inner_is_extended_only_in_client_rs() {
    for (module, code) in modules() {
        if module != "client" {
            assert!(
                !code.contains("impl Inner") && !code.contains("impl crate::client::Inner"),
                "{module}.rs extends `Inner`: a part's behaviour belongs to the part's own struct"
            );
        }
    }
}

#[test]
fn no_import_circle_spans_more_than_two_files() {
    let graph = imports(&modules());
    assert!(graph.contains_key("client") && graph["io"].contains("client"));
    let circles: Vec<_> = components(&graph)
        .into_iter()
        .filter(|c| c.len() > 2)
        .collect();
    assert!(
        circles.is_empty(),
        "modules that import each other in a circle: {circles:?} (imports: {graph:#?})"
    );
}
