//! Holding a coded row: its state, coded steps and learning updates ([`row`], [`learning`]),
//! group sessions ([`session`]), a member's side of hop groups ([`hop`]), updates spreading through the node ([`spread`]), the data dir ([`store`]), keys and certificates ([`trust`]), the native `holder::Link` ([`link`])
//! and work a node does for itself ([`background`]). The node that holds it is
//! [`crate::node`].

pub mod background;
pub mod hop;
pub mod learning;
pub mod link;
pub mod row;
pub mod session;
pub mod spread;
pub mod store;
pub mod trust;
