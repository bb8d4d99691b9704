//! The browser node in headless Chromium (wasm-bindgen-test): it refuses what it cannot use
//! with errors that say what went wrong, and never panics. The end-to-end path — dialing a real
//! mesh and following it — is `tests/tests/e2e/browser.rs`.

#![cfg(target_arch = "wasm32")]

use node_core::mesh::BrowserBootstrap;
use node_web::{BrowserNode, WebError};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

#[wasm_bindgen_test]
async fn an_origin_without_a_node_is_a_fetch_error() {
    // Port 9 (discard) on loopback: nothing answers HTTP there.
    match BrowserNode::connect("http://127.0.0.1:9", node_web::Dial::default()).await {
        Err(WebError::Fetch { url, .. }) => assert_eq!(url, "http://127.0.0.1:9/api/bootstrap"),
        other => panic!("expected a fetch error, got {other:?}"),
    }
}

#[wasm_bindgen_test]
async fn a_node_without_browser_addresses_is_a_dial_error() {
    let peer = "12D3KooWEtyUq8sdqhwmBW54jBQPPUQLqtrFcby7Zbj2unjEijzU".to_string();
    // A TCP address only: a browser cannot dial it.
    let boot = BrowserBootstrap::from_addrs(peer, &["/ip4/127.0.0.1/tcp/4001".into()]);
    assert!(boot.addrs.is_empty(), "{boot:?}");
    match BrowserNode::connect_to(boot).await {
        Err(WebError::Dial { reason, .. }) => {
            assert!(reason.contains("no address a browser can dial"), "{reason}")
        }
        other => panic!("expected a dial error, got {other:?}"),
    }
}

#[wasm_bindgen_test]
async fn a_refused_websocket_is_a_dial_error_naming_the_address() {
    let peer = "12D3KooWEtyUq8sdqhwmBW54jBQPPUQLqtrFcby7Zbj2unjEijzU";
    let addr = format!("/ip4/127.0.0.1/tcp/9/ws/p2p/{peer}");
    let boot = BrowserBootstrap::from_addrs(peer.into(), std::slice::from_ref(&addr));
    match BrowserNode::connect_to(boot).await {
        Err(WebError::Dial { addrs, reason }) => {
            assert_eq!(addrs, std::slice::from_ref(&addr));
            assert!(reason.starts_with(&addr), "{reason}");
        }
        other => panic!("expected a dial error, got {other:?}"),
    }
}

#[wasm_bindgen_test]
fn the_first_transport_is_named_or_refused() {
    use node_web::Dial;
    assert_eq!(
        "webrtc-direct".parse::<Dial>().ok(),
        Some(Dial::WebRtcFirst)
    );
    assert_eq!("websocket".parse::<Dial>().ok(), Some(Dial::WebSocketFirst));
    match "carrier-pigeon".parse::<Dial>() {
        Err(e) => assert!(
            e.to_string()
                .contains("expected websocket or webrtc-direct"),
            "{e}"
        ),
        Ok(d) => panic!("an unknown transport was taken as {d:?}"),
    }
}
