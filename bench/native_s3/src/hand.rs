//! The hand-written client: what pffs/backends/s3_native.py does, in Rust. One keep-alive HTTP/1.1
//! connection per OS thread (blocking `std::net::TcpStream`, no runtime), SigV4 signed with `hmac` + `sha2`,
//! the answer's headers parsed in place and the body read straight into the job's buffer.
//! Plain http only (the benchmark's server is on loopback); a client for the core would add rustls.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::{Job, Run, Spec, hex};

const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
const MAX_HEADER_BYTES: usize = 64 << 10;

struct Endpoint {
    host: String, // the Host header: host[:port]
    path_prefix: String,
}

pub fn prepare(spec: &Spec, jobs: Vec<Job>) -> Result<Run, String> {
    let host = spec
        .endpoint
        .strip_prefix("http://")
        .ok_or("the hand-written client speaks plain http only")?
        .trim_end_matches('/')
        .to_string();
    let endpoint = Endpoint {
        host,
        path_prefix: format!("/{}/", spec.bucket),
    };
    let signer = Signer::new(&spec.access_key, &spec.secret_key, &spec.region);
    let threads = spec.threads;
    Ok(Box::new(move || run(endpoint, signer, threads, jobs)))
}

fn run(
    endpoint: Endpoint,
    signer: Signer,
    threads: usize,
    mut jobs: Vec<Job>,
) -> Result<Vec<Job>, String> {
    jobs.reverse(); // popped from the end: taken in order
    let queue = Mutex::new(jobs);
    let done = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<(), String> {
                    let mut connection: Option<TcpStream> = None;
                    let mut head = vec![0u8; MAX_HEADER_BYTES];
                    loop {
                        let Some(mut job) = queue.lock().unwrap().pop() else {
                            return Ok(());
                        };
                        get(&endpoint, &signer, &mut connection, &mut head, &mut job)
                            .map_err(|e| format!("{}: {e}", job.key))?;
                        done.lock().unwrap().push(job);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().map_err(|_| "a thread panicked".to_string())?)
    })?;
    Ok(done.into_inner().unwrap())
}

/// One GET of the job's range into its buffer, on this thread's connection (made if there is none; made
/// once more if a kept-alive one turns out closed before answering).
fn get(
    endpoint: &Endpoint,
    signer: &Signer,
    connection: &mut Option<TcpStream>,
    head: &mut [u8],
    job: &mut Job,
) -> Result<(), String> {
    let path = endpoint.path_prefix.clone() + &uri_encode(&job.key);
    let range = format!(
        "bytes={}-{}",
        job.start,
        job.start + job.buffer.len() as u64 - 1
    );
    let request = signer.request(&endpoint.host, &path, &range);
    for attempt in 0..2 {
        let reused = connection.is_some();
        let stream = match connection {
            Some(stream) => stream,
            None => {
                let stream = TcpStream::connect(&endpoint.host).map_err(|e| e.to_string())?;
                stream.set_nodelay(true).map_err(|e| e.to_string())?;
                connection.insert(stream)
            }
        };
        match exchange(stream, request.as_bytes(), head, &mut job.buffer) {
            Ok(keep) => {
                if !keep {
                    *connection = None;
                }
                return Ok(());
            }
            Err(Failure::Closed) if reused && attempt == 0 => *connection = None, // stale keep-alive
            Err(Failure::Closed) => return Err("the server closed the connection".into()),
            Err(Failure::Other(message)) => {
                *connection = None;
                return Err(message);
            }
        }
    }
    unreachable!()
}

enum Failure {
    Closed, // closed before a byte of the answer came
    Other(String),
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure::Other(e.to_string())
    }
}

/// Sends the request and reads the answer, its body into `into`. Ok(keep the connection).
fn exchange(
    stream: &mut TcpStream,
    request: &[u8],
    head: &mut [u8],
    into: &mut [u8],
) -> Result<bool, Failure> {
    stream.write_all(request)?;
    let mut filled = 0;
    let end = loop {
        let n = stream.read(&mut head[filled..])?;
        if n == 0 {
            return Err(if filled == 0 {
                Failure::Closed
            } else {
                Failure::Other("closed mid-answer".into())
            });
        }
        let from = filled.saturating_sub(3);
        filled += n;
        if let Some(at) = head[from..filled].windows(4).position(|w| w == b"\r\n\r\n") {
            break from + at;
        }
        if filled == head.len() {
            return Err(Failure::Other("answer headers too long".into()));
        }
    };
    let text = std::str::from_utf8(&head[..end])
        .map_err(|_| Failure::Other("headers not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or(Failure::Other("not an HTTP answer".into()))?;
    let (mut length, mut keep) = (None, true);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = value.parse::<usize>().ok();
        } else if name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close") {
            keep = false;
        }
    }
    let length = length.ok_or(Failure::Other("an answer without a Content-Length".into()))?;
    let early = &head[end + 4..filled];
    if status != 200 && status != 206 {
        let body = String::from_utf8_lossy(early);
        return Err(Failure::Other(format!(
            "HTTP {status}: {}",
            body.chars().take(300).collect::<String>()
        )));
    }
    if length != into.len() || early.len() > length {
        return Err(Failure::Other(format!(
            "HTTP {status} with {length} bytes, {} asked",
            into.len()
        )));
    }
    into[..early.len()].copy_from_slice(early);
    stream
        .read_exact(&mut into[early.len()..])
        .map_err(|e| Failure::Other(format!("body: {e}")))?;
    Ok(keep)
}

/// AWS Signature Version 4, headers only, for GETs with a Range (the payload is empty).
struct Signer {
    access_key: String,
    secret_key: String,
    region: String,
    key: Mutex<Option<(String, [u8; 32])>>, // (day, signing key): one day at a time
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

impl Signer {
    fn new(access_key: &str, secret_key: &str, region: &str) -> Self {
        let (access_key, secret_key, region) =
            (access_key.into(), secret_key.into(), region.into());
        Signer {
            access_key,
            secret_key,
            region,
            key: Mutex::new(None),
        }
    }

    fn signing_key(&self, day: &str) -> [u8; 32] {
        let mut cached = self.key.lock().unwrap();
        if let Some((d, key)) = cached.as_ref()
            && d == day
        {
            return *key;
        }
        let mut key = hmac(
            format!("AWS4{}", self.secret_key).as_bytes(),
            day.as_bytes(),
        );
        for part in [self.region.as_str(), "s3", "aws4_request"] {
            key = hmac(&key, part.as_bytes());
        }
        *cached = Some((day.to_string(), key));
        key
    }

    /// The whole request, signed: request line, Host, Range, x-amz-* and Authorization.
    fn request(&self, host: &str, path: &str, range: &str) -> String {
        let stamp = amz_date(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs(),
        );
        let day = &stamp[..8];
        let names = "host;range;x-amz-content-sha256;x-amz-date";
        let canonical = format!(
            "GET\n{path}\n\nhost:{host}\nrange:{range}\nx-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{stamp}\n\n\
             {names}\n{EMPTY_SHA256}"
        );
        let scope = format!("{day}/{}/s3/aws4_request", self.region);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{}",
            hex(&Sha256::digest(canonical.as_bytes()))
        );
        let signature = hex(&hmac(&self.signing_key(day), to_sign.as_bytes()));
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\nRange: {range}\r\n\
             x-amz-content-sha256: {EMPTY_SHA256}\r\nx-amz-date: {stamp}\r\n\
             Authorization: AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={names},Signature={signature}\r\n\r\n",
            self.access_key
        )
    }
}

/// A key in a path, as SigV4 wants it for S3: every byte but unreserved ones and '/' percent-encoded.
fn uri_encode(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for &b in key.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// YYYYMMDDTHHMMSSZ for Unix seconds (days to a civil date: Howard Hinnant's algorithm).
fn amz_date(secs: u64) -> String {
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn amz_date() {
        assert_eq!(super::amz_date(0), "19700101T000000Z");
        assert_eq!(super::amz_date(1_709_251_199), "20240229T235959Z");
    }
}
