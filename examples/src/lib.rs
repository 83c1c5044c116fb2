//! Helpers shared by the examples of `#[find_executable_batch_size]` (see `examples/`).

use std::fmt;
use std::panic;
use std::sync::Arc;

use batch_size_runtime::memory::Bytes;
use cudarc::driver::CudaContext;

/// A CUDA device that the examples can use.
#[derive(Debug)]
pub struct CudaDevice {
    /// The context of device 0.
    pub context: Arc<CudaContext>,
    /// The device's name, as the driver reports it.
    pub name: String,
    /// Total bytes of device memory.
    pub total: u64,
}

impl fmt::Display for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUDA device 0: {} ({})", self.name, Bytes(self.total))
    }
}

/// Opens CUDA device 0, or says why it cannot: no driver library, no device, a driver error.
///
/// Never panics: see [`quietly`].
pub fn cuda_device() -> Result<CudaDevice, String> {
    quietly(|| {
        let context = CudaContext::new(0).map_err(|error| format!("CUDA: {error}"))?;
        let name = context.name().map_err(|error| format!("CUDA: {error}"))?;
        let total = context
            .total_mem()
            .map_err(|error| format!("CUDA: {error}"))?;
        Ok(CudaDevice {
            context,
            name,
            total: total as u64,
        })
    })
}

/// Runs `probe`, turning a panic into an error message without printing it.
///
/// cudarc loads libcuda, libcublas and libnvrtc on first use and panics where one is absent
/// (formatting a `DriverError` calls the driver too). A missing GPU library is an expected
/// situation for these examples, not a crash to report: the panic hook is silenced meanwhile.
/// Call it before any search, from one thread: the panic hook is global.
pub fn quietly<T>(probe: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    let hook = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let outcome = panic::catch_unwind(panic::AssertUnwindSafe(probe));
    panic::set_hook(hook);
    match outcome {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("a library could not be loaded");
            // cudarc goes on to list every file name it tried; the start says what is missing.
            let missing = message.split(" - searched for").next().unwrap_or(message);
            Err(missing.to_owned())
        }
    }
}

/// Installs a `tracing_subscriber` fmt subscriber that prints each event on one line, with the
/// long fields (`error`, `memory`, `reason`) on indented lines under it. `RUST_LOG` filters
/// (default `info`).
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;

    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .event_format(Readable)
        .init();
}

/// The event format of [`init_tracing`].
#[derive(Debug, Clone, Copy)]
struct Readable;

/// Fields printed on lines of their own, under the message.
const LONG_FIELDS: &[&str] = &["error", "memory", "reason"];

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Readable
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _context: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        write!(writer, "{:>5} {}", event.metadata().level(), fields.message)?;
        for (name, value) in &fields.short {
            write!(writer, " {name}={value}")?;
        }
        for (name, value) in &fields.long {
            write!(writer, "\n        {name}: {value}")?;
        }
        writeln!(writer)
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    short: Vec<(&'static str, String)>,
    long: Vec<(&'static str, String)>,
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.record(field.name(), value.to_owned());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.record(field.name(), format!("{value:?}"));
    }
}

impl Fields {
    fn record(&mut self, name: &'static str, value: String) {
        if name == "message" {
            self.message = value;
        } else if LONG_FIELDS.contains(&name) {
            self.long.push((name, value));
        } else {
            self.short.push((name, value));
        }
    }
}

// The README's and the docs' snippets run as doctests of this crate, which has what they use
// (candle on the CPU, anyhow, thiserror), so that what they teach keeps compiling and running.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/GUIDE.md")]
struct GuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/HOW_IT_WORKS.md")]
struct HowItWorksDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/SEVERAL_GPUS.md")]
struct SeveralGpusDoctests;
