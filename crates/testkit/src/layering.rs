//! A crate's layering, read from its source: which of its top-level modules name which
//! (`crate::m` paths), and the circles among them — what the layering tests of fs-client and
//! meta-server check (no import circle spans more than two modules).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The import circles of more than `files` modules in the library whose `src` directory is
/// `src`, each as its modules' names, with the whole import graph for the message.
pub fn circles_over(
    src: &Path,
    files: usize,
) -> (Vec<Vec<String>>, BTreeMap<String, BTreeSet<String>>) {
    let graph = imports(&modules(src));
    let circles = components(&graph)
        .into_iter()
        .filter(|c| c.len() > files)
        .collect();
    (circles, graph)
}

/// A library's top-level modules by name (`lib.rs` left out) with their code — comments and
/// each file's `#[cfg(test)]` part cut — from its `src` directory. A module that is a
/// directory (`store/mod.rs`, `store/space.rs`, ...) is one module: its files' code together.
pub fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if path.is_dir() {
            let mut code = String::new();
            let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
                .expect("a module directory is readable")
                .map(|e| e.expect("a directory entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "rs"))
                .collect();
            files.sort();
            for file in files {
                code += &code_of(&file);
                code.push('\n');
            }
            modules.insert(name.to_string(), code);
            continue;
        }
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module != "lib" {
            modules.insert(module.to_string(), code_of(&path));
        }
    }
    modules
}

/// A source file's code: comments and its `#[cfg(test)]` part cut.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("a source file is readable");
    let code = match text.find("#[cfg(test)]") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    code.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules each module names: `crate::m` anywhere, or `m::` inside a `use crate::{...}`.
pub fn imports(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
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
pub fn components(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
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
