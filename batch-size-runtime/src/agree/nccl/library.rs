//! Finding and loading NCCL where it is really installed.
//!
//! cudarc's loader asks the dynamic linker for `libnccl.so`, `libnccl.so.1`, `.9`–`.12` and a
//! few Windows-style names, never `libnccl.so.2`: the only name the NCCL pip wheel
//! (`nvidia-nccl-cu12`, what PyTorch installs) and Debian's `libnccl2` runtime package ship.
//! It also panics when nothing is found. So this module looks for the library itself, in
//! order:
//!
//! 1. `BATCH_SIZE_NCCL_LIBRARY`, a path, when set (and nothing else then);
//! 2. a NCCL already loaded in the process (by PyTorch, by cudarc, by you);
//! 3. `libnccl.so.2`, then `libnccl.so`, through the dynamic linker (`LD_LIBRARY_PATH` as the
//!    process started with it, the linker cache, the system folders);
//! 4. the folders of `LD_LIBRARY_PATH` as it is now, `$CUDA_HOME`/`$CUDA_PATH`'s `lib64`, and
//!    `$CONDA_PREFIX/lib`;
//! 5. the wheel's folder, `nvidia/nccl/lib`, in every `site-packages` of `$VIRTUAL_ENV`,
//!    `$CONDA_PREFIX`, `$PYTHONPATH`, `~/.local` and the system Pythons.
//!
//! It is loaded once per process and kept loaded.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

use super::NcclError;

/// The variable that names the library to load, bypassing the search.
pub const NCCL_LIBRARY_VARIABLE: &str = "BATCH_SIZE_NCCL_LIBRARY";

/// The names the library goes by, the wheel's first.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// `NCCL_VERSION(2, 14, 0)`: the first with non-blocking communicators (`ncclConfig_t`), which
/// the timeout needs: a blocking `ncclCommInitRank` waits forever for a rank that never joins.
pub(crate) const OLDEST_SUPPORTED: c_int = 21400;

pub(crate) type NcclResult = c_uint;
pub(crate) type RawComm = *mut c_void;

/// The 128 bytes of `ncclUniqueId`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawId {
    pub(crate) internal: [c_char; 128],
}

/// The entry points used, with C types (results as integers: a code this crate does not know
/// must not be undefined behaviour).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Functions {
    pub(crate) get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut RawId) -> NcclResult,
    pub(crate) comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, RawId, c_int, *mut c_void) -> NcclResult,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    pub(crate) comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    pub(crate) comm_finalize: unsafe extern "C" fn(RawComm) -> NcclResult,
    pub(crate) comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    #[allow(clippy::type_complexity)]
    pub(crate) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_uint,
        c_uint,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    pub(crate) get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub(crate) get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
}

/// NCCL, loaded.
#[derive(Debug)]
pub(crate) struct NcclLibrary {
    pub(crate) path: String,
    pub(crate) version: c_int,
    pub(crate) functions: Functions,
    // Keeps the functions above valid for the process.
    _library: Library,
}

impl NcclLibrary {
    /// The text of a result code.
    pub(crate) fn describe(&self, code: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe { (self.functions.get_error_string)(code) };
        let text = if text.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated and static.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        format!("{} ({code}): {text}", result_name(code))
    }

    /// NCCL's last error message, if it has one.
    pub(crate) fn last_error(&self, comm: RawComm) -> Option<String> {
        let get = self.functions.get_last_error?;
        // SAFETY: ncclGetLastError accepts any communicator, or null.
        let text = unsafe { get(comm) };
        if text.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated; copied at once.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        (!text.is_empty()).then(|| text.into_owned())
    }
}

/// The name of a `ncclResult_t`.
pub(crate) fn result_name(code: NcclResult) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "an unknown ncclResult_t",
    }
}

/// NCCL for this process: found and loaded on first use.
pub(crate) fn library() -> Result<&'static NcclLibrary, NcclError> {
    static LIBRARY: OnceLock<Result<NcclLibrary, NcclError>> = OnceLock::new();
    LIBRARY.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Where NCCL was loaded from, and its version (`NCCL_VERSION` code, such as 22105 for
/// 2.21.5); loads it if nothing has yet.
///
/// ```
/// // Without NCCL installed this is an error that says what to install or set.
/// match batch_size_runtime::agree::loaded_library() {
///     Ok((path, version)) => println!("NCCL {version} from {path}"),
///     Err(error) => println!("{error}"),
/// }
/// ```
pub fn loaded_library() -> Result<(&'static str, i32), NcclError> {
    library().map(|library| (library.path.as_str(), library.version))
}

fn load() -> Result<NcclLibrary, NcclError> {
    let (library, path) = find(&|name| std::env::var(name).ok())?;
    bind(library, path)
}

/// How a candidate is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Candidate {
    /// Only if already loaded in the process.
    Loaded(&'static str),
    /// By name, through the dynamic linker's search.
    Name(&'static str),
    /// A file.
    File(PathBuf),
}

/// Finds and opens the library: the first candidate that opens.
fn find(var: &dyn Fn(&str) -> Option<String>) -> Result<(Library, String), NcclError> {
    if let Some(path) = var(NCCL_LIBRARY_VARIABLE).filter(|path| !path.is_empty()) {
        return match open_file(Path::new(&path)) {
            Ok(library) => Ok((library, path)),
            Err(why) => Err(NcclError::LibraryNotFound {
                searched: vec![format!("{path} ({NCCL_LIBRARY_VARIABLE}): {why}")],
            }),
        };
    }
    let mut searched = Vec::new();
    for candidate in candidates(var, &|folder| python_folders(folder)) {
        let (opened, shown) = match &candidate {
            Candidate::Loaded(name) => (open_loaded(name), format!("{name} (loaded)")),
            Candidate::Name(name) => (open_name(name), (*name).to_owned()),
            Candidate::File(path) => {
                if !path.exists() {
                    searched.push(path.display().to_string());
                    continue;
                }
                (open_file(path), path.display().to_string())
            }
        };
        match opened {
            Ok(library) => {
                let path = match &candidate {
                    Candidate::File(path) => path.display().to_string(),
                    Candidate::Loaded(name) | Candidate::Name(name) => (*name).to_owned(),
                };
                return Ok((library, path));
            }
            Err(why) if matches!(candidate, Candidate::File(_)) => {
                searched.push(format!("{shown}: {why}"))
            }
            Err(_) => searched.push(shown),
        }
    }
    Err(NcclError::LibraryNotFound { searched })
}

/// Every place to look, in order, from the environment (`var`) and the Python folders under
/// a prefix (`pythons`: `lib/python3.*`).
pub(crate) fn candidates(
    var: &dyn Fn(&str) -> Option<String>,
    pythons: &dyn Fn(&Path) -> Vec<PathBuf>,
) -> Vec<Candidate> {
    let mut found: Vec<Candidate> = NAMES.iter().map(|name| Candidate::Loaded(name)).collect();
    found.extend(NAMES.iter().map(|name| Candidate::Name(name)));
    let mut folders: Vec<PathBuf> = Vec::new();
    if let Some(paths) = var("LD_LIBRARY_PATH") {
        folders.extend(split_paths(&paths));
    }
    for variable in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = var(variable).filter(|home| !home.is_empty()) {
            folders.push(Path::new(&home).join("lib64"));
        }
    }
    if let Some(conda) = var("CONDA_PREFIX").filter(|conda| !conda.is_empty()) {
        folders.push(Path::new(&conda).join("lib"));
    }
    // The wheel: <site-packages>/nvidia/nccl/lib.
    let mut site_packages: Vec<PathBuf> = Vec::new();
    for variable in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = var(variable).filter(|prefix| !prefix.is_empty()) {
            for python in pythons(Path::new(&prefix)) {
                site_packages.push(python.join("site-packages"));
            }
        }
    }
    if let Some(paths) = var("PYTHONPATH") {
        site_packages.extend(split_paths(&paths));
    }
    if let Some(home) = var("HOME").filter(|home| !home.is_empty()) {
        for python in pythons(&Path::new(&home).join(".local")) {
            site_packages.push(python.join("site-packages"));
        }
    }
    for prefix in ["/usr/local", "/usr"] {
        for python in pythons(Path::new(prefix)) {
            site_packages.push(python.join("dist-packages"));
            site_packages.push(python.join("site-packages"));
        }
    }
    site_packages.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    folders.extend(
        site_packages
            .into_iter()
            .map(|packages| packages.join("nvidia").join("nccl").join("lib")),
    );
    let mut seen = std::collections::HashSet::new();
    for folder in folders {
        for name in NAMES {
            let file = folder.join(name);
            if seen.insert(file.clone()) {
                found.push(Candidate::File(file));
            }
        }
    }
    found
}

fn split_paths(paths: &str) -> impl Iterator<Item = PathBuf> + '_ {
    paths
        .split(':')
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// `prefix/lib/python3.*`, newest name last.
fn python_folders(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut folders: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path())
        .collect();
    folders.sort();
    folders
}

fn open_file(path: &Path) -> Result<Library, String> {
    // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
    unsafe { Library::new(path) }.map_err(|error| error.to_string())
}

fn open_name(name: &str) -> Result<Library, String> {
    // SAFETY: as above.
    unsafe { Library::new(name) }.map_err(|error| error.to_string())
}

#[cfg(unix)]
fn open_loaded(name: &str) -> Result<Library, String> {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_NOW};
    // glibc's RTLD_NOLOAD: open only what is already loaded (libloading does not name it).
    #[cfg(target_os = "linux")]
    const RTLD_NOLOAD: c_int = 0x4;
    #[cfg(not(target_os = "linux"))]
    const RTLD_NOLOAD: c_int = 0x10;
    // SAFETY: nothing is loaded, so nothing is initialised.
    unsafe { UnixLibrary::open(Some(name), RTLD_NOW | RTLD_NOLOAD) }
        .map(Library::from)
        .map_err(|error| error.to_string())
}

#[cfg(not(unix))]
fn open_loaded(_name: &str) -> Result<Library, String> {
    Err("not on this platform".to_owned())
}

/// Looks up every entry point; checks the version.
fn bind(library: Library, path: String) -> Result<NcclLibrary, NcclError> {
    fn symbol<T: Copy>(library: &Library, path: &str, name: &'static str) -> Result<T, NcclError> {
        // SAFETY: `T` is the entry point's C signature (see `Functions`).
        unsafe { library.get::<T>(name.as_bytes()) }
            .map(|found| *found)
            .map_err(|_| NcclError::MissingSymbol {
                symbol: name,
                path: path.to_owned(),
            })
    }
    let functions = Functions {
        get_version: symbol(&library, &path, "ncclGetVersion")?,
        get_unique_id: symbol(&library, &path, "ncclGetUniqueId")?,
        comm_init_rank_config: symbol(&library, &path, "ncclCommInitRankConfig")?,
        comm_get_async_error: symbol(&library, &path, "ncclCommGetAsyncError")?,
        comm_abort: symbol(&library, &path, "ncclCommAbort")?,
        comm_finalize: symbol(&library, &path, "ncclCommFinalize")?,
        comm_destroy: symbol(&library, &path, "ncclCommDestroy")?,
        all_reduce: symbol(&library, &path, "ncclAllReduce")?,
        get_error_string: symbol(&library, &path, "ncclGetErrorString")?,
        get_last_error: symbol(&library, &path, "ncclGetLastError").ok(),
    };
    let mut version: c_int = 0;
    // SAFETY: a valid out-pointer.
    let code = unsafe { (functions.get_version)(&mut version) };
    if code != 0 || version < OLDEST_SUPPORTED {
        return Err(NcclError::TooOld { version, path });
    }
    tracing::debug!(path = %path, version, "NCCL loaded");
    Ok(NcclLibrary {
        path,
        version,
        functions,
        _library: library,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
        }
    }

    fn files(candidates: &[Candidate]) -> Vec<String> {
        candidates
            .iter()
            .filter_map(|candidate| match candidate {
                Candidate::File(path) => Some(path.display().to_string()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_wheel_name_comes_first_and_loaded_libraries_before_any_search() {
        let found = candidates(&env(&[]), &|_| Vec::new());
        assert_eq!(found[0], Candidate::Loaded("libnccl.so.2"));
        assert_eq!(found[1], Candidate::Loaded("libnccl.so"));
        assert_eq!(found[2], Candidate::Name("libnccl.so.2"));
        assert_eq!(found[3], Candidate::Name("libnccl.so"));
    }

    #[test]
    fn the_wheel_folder_of_a_virtual_environment_is_searched() {
        let found = candidates(&env(&[("VIRTUAL_ENV", "/venv")]), &|prefix| {
            vec![prefix.join("lib").join("python3.11")]
        });
        let files = files(&found);
        assert!(
            files.contains(
                &"/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2".to_owned()
            ),
            "{files:?}"
        );
    }

    #[test]
    fn library_path_folders_as_they_are_now_come_before_the_wheels() {
        let found = candidates(
            &env(&[
                ("LD_LIBRARY_PATH", "/opt/nccl/lib::/other"),
                ("PYTHONPATH", "/py"),
            ]),
            &|_| Vec::new(),
        );
        let files = files(&found);
        let nccl = files
            .iter()
            .position(|file| file == "/opt/nccl/lib/libnccl.so.2")
            .unwrap();
        let wheel = files
            .iter()
            .position(|file| file == "/py/nvidia/nccl/lib/libnccl.so.2")
            .unwrap();
        assert!(nccl < wheel, "{files:?}");
        assert!(files.contains(&"/other/libnccl.so".to_owned()));
    }

    #[test]
    fn an_explicit_library_that_does_not_open_is_an_error_naming_it() {
        let error = find(&env(&[(NCCL_LIBRARY_VARIABLE, "/nowhere/libnccl.so.2")]))
            .map(|_| ())
            .unwrap_err();
        let message = error.to_string();
        assert!(message.contains("/nowhere/libnccl.so.2"), "{message}");
        assert!(message.contains("BATCH_SIZE_NCCL_LIBRARY"), "{message}");
    }
}
