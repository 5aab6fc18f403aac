//! The crate's layering, checked from its source: `Inner` is extended only in `client.rs`,
//! and no import circle among the library's modules spans more than two files (each module
//! uses those below it; see the crate docs).
//!
//! A module's imports are the `crate::<module>` paths its code names (comments and its
//! `#[cfg(test)]` part left out), `lib.rs` being the root that declares them all
//! (`testkit::layering`).

use std::path::PathBuf;

/// This library's source directory.
fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn inner_is_extended_only_in_client_rs() {
    for (module, code) in testkit::layering::modules(&src()) {
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
    let (circles, graph) = testkit::layering::circles_over(&src(), 2);
    assert!(graph.contains_key("client") && graph["io"].contains("client"));
    assert!(
        circles.is_empty(),
        "modules that import each other in a circle: {circles:?} (imports: {graph:#?})"
    );
}
