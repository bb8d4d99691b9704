//! Mounts the dashboard.

#[cfg(wasm_browser)]
fn main() {
    leptos::mount::mount_to_body(web_ui::app::App);
}

#[cfg(not(wasm_browser))]
fn main() {
    eprintln!("the dashboard runs in a browser: build it with `bash scripts/build-web.sh`");
}
