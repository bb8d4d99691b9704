//! Target aliases: `native` and `wasm_browser`, so `cfg` reads the same everywhere.
fn main() {
    // The aliases depend on the target alone. Without this line cargo runs the script again
    // whenever any file of the package changes (a test, a README), and rebuilds the crate
    // and everything that depends on it.
    println!("cargo:rerun-if-changed=build.rs");
    cfg_aliases::cfg_aliases! {
        wasm_browser: { all(target_family = "wasm", target_os = "unknown") },
        native: { not(target_family = "wasm") },
    }
}
