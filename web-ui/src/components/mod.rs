//! The dashboard's parts, each reading the shared [`crate::app::Live`] context.

mod chart;
mod rows;
mod summary;

pub use chart::{HistoryChart, LiveNumbers};
pub use rows::RowsTable;
pub use summary::Summary;
