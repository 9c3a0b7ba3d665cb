//! `examples/tour.rs` runs, so the crate's tour stays true.

#[path = "../examples/tour.rs"]
mod tour;

#[test]
fn the_tour_runs() {
    tour::main().unwrap();
}
