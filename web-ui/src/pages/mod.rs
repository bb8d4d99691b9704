//! One file per page.

pub mod dashboard;
