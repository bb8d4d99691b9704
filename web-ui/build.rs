//! Target aliases: `native` and `wasm_browser`, so `cfg` reads the same everywhere.
fn main() {
    cfg_aliases::cfg_aliases! {
        wasm_browser: { all(target_family = "wasm", target_os = "unknown") },
        native: { not(target_family = "wasm") },
    }
}
