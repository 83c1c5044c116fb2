// `async fn`: each attempt is awaited; panics inside it are caught like a synchronous body's.
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

fn block_on<F: Future>(future: F) -> F::Output {
    let waker = Waker::from(Arc::new(Noop));
    let mut context = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(value) = future.as_mut().poll(&mut context) {
            return value;
        }
    }
}

/// Pending once, then ready: proves the attempt is really polled more than once.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, context: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            context.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

#[find_executable_batch_size(starting = 64)]
async fn train(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
    YieldOnce(false).await;
    if batch_size > limit {
        return Err(OutOfMemory::new().into());
    }
    Ok(batch_size)
}

#[find_executable_batch_size(starting = 64)]
async fn train_panicking(batch_size: usize, log: &mut Vec<usize>) -> usize {
    log.push(batch_size);
    YieldOnce(false).await;
    if batch_size > 8 {
        panic!("CUDA out of memory. Tried to allocate 2.00 GiB");
    }
    batch_size
}

struct Trainer {
    limit: usize,
}

impl Trainer {
    #[find_executable_batch_size(starting = 10)]
    async fn fit(&self, batch_size: usize) -> std::io::Result<usize> {
        if batch_size > self.limit {
            return Err(std::io::Error::other(OutOfMemory::new()));
        }
        Ok(batch_size)
    }

    // `&mut self`: each attempt borrows it in turn (through an async closure).
    #[find_executable_batch_size(starting = 16)]
    async fn fit_counting(&mut self, batch_size: usize, seen: &mut Vec<usize>) -> anyhow::Result<usize> {
        seen.push(batch_size);
        YieldOnce(false).await;
        if batch_size > self.limit {
            self.limit += 0;
            return Err(OutOfMemory::new().into());
        }
        Ok(batch_size)
    }
}

/// `impl Trait` in the return type: only a panic can be out-of-memory.
#[find_executable_batch_size(starting = 8)]
async fn shown(batch_size: usize) -> impl std::fmt::Display {
    YieldOnce(false).await;
    if batch_size > 2 {
        panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
    }
    batch_size
}

/// Generic, with a where clause and an owned parameter cloned for each attempt.
#[find_executable_batch_size(starting = start)]
async fn generic<T>(batch_size: u32, start: u32, items: Vec<T>) -> Result<usize, std::io::Error>
where
    T: Clone + Send,
{
    YieldOnce(false).await;
    if batch_size as usize > items.len() {
        return Err(std::io::Error::from(std::io::ErrorKind::OutOfMemory));
    }
    Ok(batch_size as usize)
}

/// With `effective`: each attempt gets a plan of micro-batches.
#[find_executable_batch_size(starting = 32, effective = 64)]
async fn accumulate(plan: batch_size_runtime::BatchPlan) -> anyhow::Result<usize> {
    YieldOnce(false).await;
    if plan.micro() > 8 {
        return Err(OutOfMemory::new().into());
    }
    Ok(plan.accumulation())
}

struct Counter(usize);

impl Counter {
    /// `&mut self` and `impl Trait` together: an async closure, only panics can be OOM.
    #[find_executable_batch_size(starting = 8)]
    async fn shown(&mut self, batch_size: usize) -> impl std::fmt::Display {
        self.0 += 1;
        YieldOnce(false).await;
        if batch_size > 2 {
            panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
        }
        batch_size
    }
}

/// A future that is `Send` when its attempts are: spawnable on a multi-threaded executor.
fn assert_send<F: Future + Send>(future: F) -> F {
    future
}

pub fn main() {
    batch_size_runtime::oom::set_quiet_oom_panics(true);
    assert_eq!(block_on(train(20)).unwrap(), 16);
    let mut log = Vec::new();
    assert_eq!(block_on(train_panicking(&mut log)), 8);
    assert_eq!(log, [64, 32, 16, 8]);
    assert_eq!(block_on(Trainer { limit: 3 }.fit()).unwrap(), 2);
    let mut trainer = Trainer { limit: 5 };
    let mut seen = Vec::new();
    assert_eq!(block_on(trainer.fit_counting(&mut seen)).unwrap(), 4);
    assert_eq!(seen, [16, 8, 4]);
    // `&mut` parameters are lent to each attempt without making the future lose `Send`.
    let mut log = Vec::new();
    assert_eq!(block_on(assert_send(train_panicking(&mut log))), 8);
    assert_eq!(block_on(assert_send(train(20))).unwrap(), 16);
    assert_eq!(block_on(shown()).to_string(), "2");
    assert_eq!(block_on(generic(16, vec!['a'; 5])).unwrap(), 4);
    assert_eq!(block_on(accumulate()).unwrap(), 8);
    let mut counter = Counter(0);
    assert_eq!(block_on(counter.shown()).to_string(), "2");
    assert_eq!(counter.0, 3); // 8, 4, 2
}
