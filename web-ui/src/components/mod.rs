//! The dashboard's parts, each reading the shared [`crate::live::Live`] context.

mod ask;
mod chart;
mod contribute;
mod learning;
mod rows;
mod summary;

pub use ask::{Ask, completion_text};
pub use chart::{HistoryChart, LiveNumbers};
pub use contribute::{Contribute, contribution_text};
pub use learning::Learning;
pub use rows::RowsTable;
pub use summary::Summary;
