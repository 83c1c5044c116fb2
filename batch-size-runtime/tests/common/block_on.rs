//! A minimal executor for the tests and benches of this crate: the futures they poll never wait
//! on anything, so polling until ready is enough (no runtime needed).

/// Polls `future` on this thread until it is ready.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut context) {
            return value;
        }
    }
}
