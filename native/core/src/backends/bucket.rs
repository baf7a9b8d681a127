//! One S3 bucket as the native engine reads it: LIST, HEAD and ranged GETs, each retried within one
//! deadline (`--backend-timeout`) the way pffs/backends/retry.py does for the Python engine: capped,
//! jittered exponential backoff, throttling answered with longer pauses, a store that refuses
//! connections given up on after a few attempts, permanent answers (403, 404, a changed object) at once.
//!
//! Where the bucket is and who signs (endpoint, region, credentials) is decided in Python from botocore,
//! once, when the mount starts.

use std::cell::Cell;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::s3_get::{self, Credentials, Endpoint, Get, GetError, Signer, Timeouts};
use super::s3_list::{self, Head, List, ListPage, ObjectInfo};
use crate::sync::{read, write};

const BASE_DELAY: Duration = Duration::from_millis(100);
const THROTTLED_DELAY: Duration = Duration::from_millis(500);
const MAX_DELAY: Duration = Duration::from_secs(2);
/// The least time left worth a last attempt: a pause ends this long before the deadline.
const LAST_ATTEMPT: Duration = Duration::from_millis(200);
/// Connections refused this many times in a row: the store is down, not slow; fail now (stale-if-error
/// or the error reaches the reader in about a second, not at the deadline).
const REFUSED_ATTEMPTS: u32 = 4;

/// Where the bucket is and how long a call may take.
#[derive(Clone, Debug)]
pub struct BucketConfig {
    /// As sent in the Host header (with the port if it is not the default).
    pub host: String,
    pub connect_host: String,
    pub port: u16,
    /// "/bucket/" (path style) or "/" (virtual-host style).
    pub path_prefix: String,
    pub region: String,
    /// (access key, secret key, session token); None: anonymous.
    pub credentials: Option<OwnedCredentials>,
    pub connect_timeout: Duration,
    /// Each wait for the next bytes of an answer (a stalled answer is abandoned and retried).
    pub read_timeout: Duration,
    /// One call, retries included.
    pub deadline: Duration,
}

/// (access key, secret key, session token).
pub type OwnedCredentials = (String, String, Option<String>);

pub struct Bucket {
    config: BucketConfig,
    signer: Signer,
    /// The credentials now: replaced while the mount runs (temporary credentials expire), so each
    /// call takes the current ones (config.credentials are the first).
    credentials: RwLock<Option<Arc<OwnedCredentials>>>,
}

impl Bucket {
    pub fn new(config: BucketConfig) -> Self {
        let signer = Signer::new(&config.region);
        let credentials = RwLock::new(config.credentials.clone().map(Arc::new));
        Bucket {
            config,
            signer,
            credentials,
        }
    }

    /// From now on, calls are signed with `credentials` (None: unsigned).
    pub fn set_credentials(&self, credentials: Option<OwnedCredentials>) {
        *write(&self.credentials) = credentials.map(Arc::new);
    }

    fn current_credentials(&self) -> Option<Arc<OwnedCredentials>> {
        read(&self.credentials).clone()
    }

    fn endpoint(&self) -> Endpoint<'_> {
        Endpoint {
            host: &self.config.host,
            connect_host: &self.config.connect_host,
            port: self.config.port,
            path_prefix: &self.config.path_prefix,
        }
    }

    fn timeouts(&self, deadline: Instant) -> Timeouts {
        Timeouts {
            connect: self.config.connect_timeout,
            read: self.config.read_timeout,
            deadline: Some(deadline),
        }
    }

    /// Every object and common prefix under `prefix`, one level deep (delimiter "/").
    pub fn list_dir(&self, prefix: &str) -> Result<ListPage, GetError> {
        let owned = self.current_credentials();
        self.retried(|timeouts| {
            s3_list::list_all(
                &self.signer,
                &List {
                    endpoint: self.endpoint(),
                    prefix,
                    delimiter: Some("/"),
                    continuation: None,
                    max_keys: 1000,
                    credentials: borrowed(&owned),
                    timeouts,
                },
            )
        })
    }

    /// The object's size, ETag and time; None if there is no such key.
    pub fn head(&self, key: &str) -> Result<Option<ObjectInfo>, GetError> {
        let owned = self.current_credentials();
        self.retried(|timeouts| {
            s3_list::head(
                &self.signer,
                &Head {
                    endpoint: self.endpoint(),
                    key,
                    credentials: borrowed(&owned),
                    timeouts,
                },
            )
        })
    }

    /// Bytes [start, start + length) of the version of `key` whose ETag is `etag`
    /// (GetError::Changed if that version is gone).
    pub fn get(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        length: usize,
    ) -> Result<Vec<u8>, GetError> {
        let mut into = vec![0u8; length];
        let owned = self.current_credentials();
        self.retried(|timeouts| {
            s3_get::get(
                &self.signer,
                &Get {
                    endpoint: self.endpoint(),
                    key,
                    start,
                    etag: Some(etag),
                    version_id: None,
                    credentials: borrowed(&owned),
                    timeouts,
                },
                &mut into,
            )
        })?;
        Ok(into)
    }

    /// `attempt` until it succeeds, fails for good, or the deadline comes.
    fn retried<T>(
        &self,
        mut attempt: impl FnMut(Timeouts) -> Result<T, GetError>,
    ) -> Result<T, GetError> {
        let deadline = Instant::now() + self.config.deadline;
        let mut refused_in_row = 0;
        for tried in 0u32.. {
            let err = match attempt(self.timeouts(deadline)) {
                Ok(value) => return Ok(value),
                Err(err) => err,
            };
            let Some(throttled) = temporary(&err) else {
                return Err(err);
            };
            refused_in_row = if refused(&err) { refused_in_row + 1 } else { 0 };
            let left = deadline.saturating_duration_since(Instant::now());
            if left <= LAST_ATTEMPT || refused_in_row >= REFUSED_ATTEMPTS {
                return Err(err);
            }
            std::thread::sleep(backoff(tried, throttled).min(left - LAST_ATTEMPT));
        }
        unreachable!()
    }
}

fn borrowed(owned: &Option<Arc<OwnedCredentials>>) -> Option<Credentials<'_>> {
    owned
        .as_deref()
        .map(|(access_key, secret_key, token)| Credentials {
            access_key,
            secret_key,
            token: token.as_deref(),
        })
}

/// Whether a failure is worth another attempt, and whether it said "slow down": Some(throttled).
fn temporary(err: &GetError) -> Option<bool> {
    match err {
        GetError::Io { .. } => Some(false),
        GetError::Answer { status, .. } if *status == 503 || *status == 429 => Some(true),
        GetError::Answer { status, .. } if *status >= 500 => Some(false),
        _ => None,
    }
}

fn refused(err: &GetError) -> bool {
    matches!(err, GetError::Io { errno, .. } if *errno == libc::ECONNREFUSED)
}

/// Between half and all of the base delay doubled per attempt, capped.
fn backoff(tried: u32, throttled: bool) -> Duration {
    let base = if throttled {
        THROTTLED_DELAY
    } else {
        BASE_DELAY
    };
    let capped = MAX_DELAY.min(base * 2u32.saturating_pow(tried.min(16)));
    capped.mul_f64(0.5 + jitter() / 2.0)
}

/// A number in [0, 1): xorshift per thread, seeded from the clock (jitter needs no better).
fn jitter() -> f64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
        );
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// The errno a reader gets for a failed call.
pub fn errno_of(err: &GetError) -> i32 {
    match err {
        GetError::Io { errno, .. } => *errno,
        GetError::Answer { status: 404, .. } => libc::ENOENT,
        GetError::Answer { status: 403, .. } => libc::EACCES,
        // If-Match answered 412: the version pinned at open is gone.
        GetError::Changed | GetError::Answer { status: 412, .. } => libc::ESTALE,
        _ => libc::EIO,
    }
}

/// One line for the log: what failed, without the request (so no credentials).
pub fn describe(err: &GetError) -> String {
    match err {
        GetError::Io { message, .. } => message.clone(),
        GetError::Answer { status, body } => {
            let text = String::from_utf8_lossy(body);
            let code = text
                .split("<Code>")
                .nth(1)
                .and_then(|rest| rest.split("</Code>").next())
                .unwrap_or("");
            format!("HTTP {status} {code}").trim_end().to_string()
        }
        GetError::Changed => "the object changed".into(),
        GetError::NotHandled(what) => format!("not handled natively: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        for tried in 0..20 {
            for throttled in [false, true] {
                let pause = backoff(tried, throttled);
                let base = if throttled {
                    THROTTLED_DELAY
                } else {
                    BASE_DELAY
                };
                let full = MAX_DELAY.min(base * 2u32.pow(tried.min(16)));
                assert!(pause >= full / 2 && pause <= full, "{tried} {pause:?}");
            }
        }
    }

    #[test]
    fn only_the_network_and_server_errors_are_retried() {
        let io = GetError::Io {
            errno: libc::ECONNRESET,
            message: "reset".into(),
        };
        let answer = |status| GetError::Answer {
            status,
            body: vec![],
        };
        assert_eq!(temporary(&io), Some(false));
        assert_eq!(temporary(&answer(503)), Some(true));
        assert_eq!(temporary(&answer(500)), Some(false));
        assert_eq!(temporary(&answer(404)), None);
        assert_eq!(temporary(&GetError::Changed), None);
        assert_eq!(errno_of(&GetError::Changed), libc::ESTALE);
        assert_eq!(errno_of(&answer(404)), libc::ENOENT);
        assert_eq!(errno_of(&answer(412)), libc::ESTALE);
    }

    #[test]
    fn a_refusing_store_fails_in_a_few_attempts_and_a_silent_one_at_the_deadline() {
        let bucket = Bucket::new(BucketConfig {
            host: "127.0.0.1:1".into(),
            connect_host: "127.0.0.1".into(),
            port: 1, // nothing listens on port 1: refused at once
            path_prefix: "/b/".into(),
            region: "us-east-1".into(),
            credentials: None,
            connect_timeout: Duration::from_millis(200),
            read_timeout: Duration::from_millis(200),
            deadline: Duration::from_secs(30),
        });
        let started = Instant::now();
        let err = bucket.get("k", "\"e\"", 0, 10).unwrap_err();
        assert_eq!(errno_of(&err), libc::ECONNREFUSED);
        assert!(started.elapsed() < Duration::from_secs(10));

        // Accepts connections, never answers: ends at the (1 s) deadline, timed out.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let silent = Bucket::new(BucketConfig {
            host: format!("127.0.0.1:{port}"),
            connect_host: "127.0.0.1".into(),
            port,
            path_prefix: "/b/".into(),
            region: "us-east-1".into(),
            credentials: None,
            connect_timeout: Duration::from_millis(200),
            read_timeout: Duration::from_millis(300),
            deadline: Duration::from_secs(1),
        });
        let started = Instant::now();
        let err = silent.head("k").unwrap_err();
        assert_eq!(errno_of(&err), libc::ETIMEDOUT);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(700), "{took:?}");
        drop(listener);
    }
}
