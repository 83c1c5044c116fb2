//! A loopback port nobody listens on, for the exchange's tests.

use std::net::TcpListener;

/// A port the system just handed out on 127.0.0.1 and took back.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|error| panic!("no free loopback port: {error}"))
}
