//! The crate's layering, checked from its source: no import circle among the library's
//! modules spans more than two files (each part uses those below it; `Service` dispatches over
//! them). A module's imports are the `crate::<module>` paths its code names, comments and its
//! `#[cfg(test)]` part left out (`testkit::layering`); `store/` counts as one module.

use std::path::PathBuf;

#[test]
fn no_import_circle_spans_more_than_two_files() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let (circles, graph) = testkit::layering::circles_over(&src, 2);
    assert!(graph.contains_key("service") && graph["service"].contains("sessions"));
    assert!(
        circles.is_empty(),
        "modules that import each other in a circle: {circles:?} (imports: {graph:#?})"
    );
}
