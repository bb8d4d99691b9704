//! Serving users: the HTTP server ([`http`]), the OpenAI API on it ([`api`]), the engine that
//! batches and leads its requests and trains on them ([`engine`]) and `/metrics` ([`metrics`]).

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;
