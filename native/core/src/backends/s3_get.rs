//! S3 ranged GETs into the caller's buffer: the block fetches that carry almost every byte pffs reads.
//! pffs/backends/s3_native.py's GET, natively (its design, measured in docs/design/native_s3_clients.md:
//! 0.089 ms of CPU per small GET against 0.27 for the Python client and 0.28 for `object_store`): SigV4
//! signed with `hmac` + `sha2`, one keep-alive HTTP/1.1 connection per OS thread and endpoint (blocking
//! sockets, no runtime, nothing a `fork()` can break), the answer's headers parsed in place and the body
//! read straight into the buffer. Plain http only: TLS stays with Python's `ssl` until the core has one.
//!
//! Where the request goes and who signs it (the endpoint, region and credentials) is decided in Python,
//! from botocore; what the answer means (an S3 error's exception) too: an error answer comes back as its
//! status and body. This module only moves bytes, within a deadline.
//!
//! The connection table, the signing and the answer's head are shared with s3_list.rs (LIST and HEAD).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::sync::lock;

const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
const MAX_HEADER_BYTES: usize = 64 << 10;
/// An error answer longer than this is not S3's (its XML is a few hundred bytes).
const MAX_ERROR_BODY: usize = 64 << 10;
/// The shortest wait: a past deadline still times out at once rather than blocking.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// Where a bucket's objects are.
pub struct Endpoint<'a> {
    /// As sent in the Host header (with the port if it is not the default).
    pub host: &'a str,
    pub connect_host: &'a str,
    pub port: u16,
    /// "/bucket/" (path style) or "/" (virtual-host style).
    pub path_prefix: &'a str,
}

pub struct Credentials<'a> {
    pub access_key: &'a str,
    pub secret_key: &'a str,
    pub token: Option<&'a str>,
}

/// When each wait for the network ends: `read` (or `connect`) for one wait, and never past `deadline`.
#[derive(Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub read: Duration,
    pub deadline: Option<Instant>,
}

impl Timeouts {
    fn wait(&self, longest: Duration) -> Duration {
        let left = match self.deadline {
            Some(at) => longest.min(at.saturating_duration_since(Instant::now())),
            None => longest,
        };
        left.max(MIN_WAIT) // (a zero timeout is refused by the socket calls)
    }
}

/// One ranged GET: bytes [start, start + buffer length) of `key`, of the version `version_id` names, or
/// the one whose ETag is `etag`.
pub struct Get<'a> {
    pub endpoint: Endpoint<'a>,
    pub key: &'a str,
    pub start: u64,
    pub etag: Option<&'a str>,
    pub version_id: Option<&'a str>,
    pub credentials: Option<Credentials<'a>>,
    pub timeouts: Timeouts,
}

#[derive(Debug)]
pub enum GetError {
    /// Something this client does not do (a redirect, a chunked or too long answer, a server that
    /// ignores Range): the caller goes through another client from now on.
    NotHandled(String),
    /// An S3 error answer: its status and (up to MAX_ERROR_BODY of) its body, for the caller to name.
    Answer { status: u16, body: Vec<u8> },
    /// The object's ETag is no longer the one asked for.
    Changed,
    /// The network: refused, reset, timed out (ETIMEDOUT), cut short (ECONNRESET), short (EIO): an errno
    /// and what happened.
    Io { errno: i32, message: String },
}

impl From<io::Error> for GetError {
    fn from(err: io::Error) -> Self {
        use io::ErrorKind::*;
        let code = err.raw_os_error().unwrap_or(match err.kind() {
            TimedOut | WouldBlock => libc::ETIMEDOUT,
            ConnectionReset | UnexpectedEof => libc::ECONNRESET,
            ConnectionRefused => libc::ECONNREFUSED,
            ConnectionAborted => libc::ECONNABORTED,
            BrokenPipe => libc::EPIPE,
            _ => libc::EIO,
        });
        // A socket timeout reads as EAGAIN; callers retry on a timeout, so say it is one.
        let code = if code == libc::EAGAIN {
            libc::ETIMEDOUT
        } else {
            code
        };
        let message = if code == libc::ETIMEDOUT {
            "timed out".to_string() // as Python's socket says
        } else {
            let text = err.to_string();
            text.split(" (os error").next().unwrap_or(&text).to_string()
        };
        GetError::Io {
            errno: code,
            message,
        }
    }
}

pub(super) fn errno(code: i32, message: String) -> GetError {
    GetError::Io {
        errno: code,
        message,
    }
}

/// AWS Signature Version 4, headers only (a GET, a HEAD, a LIST have no payload). Keeps one signing
/// key: one day, one secret at a time.
pub struct Signer {
    region: String,
    key: Mutex<Option<(String, String, [u8; 32])>>, // (secret, day, key)
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

impl Signer {
    pub fn new(region: &str) -> Self {
        Signer {
            region: region.to_string(),
            key: Mutex::new(None),
        }
    }

    fn signing_key(&self, secret: &str, day: &str) -> [u8; 32] {
        let mut cached = lock(&self.key);
        if let Some((s, d, key)) = cached.as_ref()
            && s == secret
            && d == day
        {
            return *key;
        }
        let mut key = hmac(format!("AWS4{secret}").as_bytes(), day.as_bytes());
        for part in [self.region.as_str(), "s3", "aws4_request"] {
            key = hmac(&key, part.as_bytes());
        }
        *cached = Some((secret.to_string(), day.to_string(), key));
        key
    }

    /// `headers` (lower-case names) plus x-amz-date, x-amz-content-sha256, the session token and
    /// Authorization, for a `method` (GET, HEAD) of `path?query` (`query` as canonical_query makes it)
    /// on `host`.
    #[allow(clippy::too_many_arguments)] // (the parts of one canonical request, each named)
    fn sign(
        &self,
        method: &str,
        creds: &Credentials<'_>,
        host: &str,
        path: &str,
        query: &str,
        headers: &mut Vec<(String, String)>,
        stamp: &str,
    ) {
        let day = &stamp[..8];
        headers.push(("x-amz-content-sha256".into(), EMPTY_SHA256.into()));
        headers.push(("x-amz-date".into(), stamp.into()));
        if let Some(token) = creds.token {
            headers.push(("x-amz-security-token".into(), token.into()));
        }
        let mut signed: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([("host", host)])
            .collect();
        signed.sort_unstable();
        let names = signed.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(";");
        let mut canonical = format!("{method}\n{path}\n{query}\n");
        for (k, v) in &signed {
            canonical.push_str(&format!("{k}:{v}\n"));
        }
        canonical.push_str(&format!("\n{names}\n{EMPTY_SHA256}"));
        let scope = format!("{day}/{}/s3/aws4_request", self.region);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{}",
            hex(&Sha256::digest(canonical.as_bytes()))
        );
        let signature = hex(&hmac(
            &self.signing_key(creds.secret_key, day),
            to_sign.as_bytes(),
        ));
        headers.push((
            "authorization".into(),
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope},SignedHeaders={names},Signature={signature}",
                creds.access_key
            ),
        ));
    }
}

/// A key (or a query value, without `keep_slash`) as SigV4 wants it for S3: every byte but unreserved
/// ones percent-encoded (Python's `quote(key, safe="/~")`).
pub(super) fn uri_encode(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// SigV4's canonical query string, which is also what goes on the wire: names and values URI-encoded
/// ('/' too), the pairs sorted by name (then value), a bare name written `name=`.
pub(super) fn canonical_query(params: &[(&str, &str)]) -> String {
    let mut encoded: Vec<(String, String)> = params
        .iter()
        .map(|(name, value)| (uri_encode(name, false), uri_encode(value, false)))
        .collect();
    encoded.sort_unstable();
    let pairs: Vec<String> = encoded
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    pairs.join("&")
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

/// The GET's bytes.
fn request(signer: &Signer, get: &Get<'_>, length: usize) -> Vec<u8> {
    let path = format!("{}{}", get.endpoint.path_prefix, uri_encode(get.key, true));
    let query = get
        .version_id
        .map(|v| canonical_query(&[("versionId", v)]))
        .unwrap_or_default();
    let end = get.start + length as u64 - 1;
    let mut headers = vec![("range".to_string(), format!("bytes={}-{end}", get.start))];
    if let (Some(etag), None) = (get.etag, get.version_id) {
        headers.push(("if-match".into(), etag.into()));
    }
    request_bytes(
        signer,
        "GET",
        &get.endpoint,
        &path,
        &query,
        headers,
        get.credentials.as_ref(),
    )
}

/// A request's bytes: `method path?query` (`path` URI-encoded, `query` as canonical_query makes it) with
/// `headers` (lower-case names), signed if there are credentials.
pub(super) fn request_bytes(
    signer: &Signer,
    method: &str,
    endpoint: &Endpoint<'_>,
    path: &str,
    query: &str,
    mut headers: Vec<(String, String)>,
    credentials: Option<&Credentials<'_>>,
) -> Vec<u8> {
    if let Some(creds) = credentials {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        signer.sign(
            method,
            creds,
            endpoint.host,
            path,
            query,
            &mut headers,
            &amz_date(now),
        );
    }
    let target = if query.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{query}")
    };
    let mut wire = format!(
        "{method} {target} HTTP/1.1\r\nHost: {}\r\nConnection: keep-alive\r\n",
        endpoint.host
    );
    for (k, v) in &headers {
        wire.push_str(&format!("{k}: {v}\r\n"));
    }
    wire.push_str("\r\n");
    wire.into_bytes()
}

type Address = (String, u16);

/// This thread's keep-alive connections, one per endpoint. A forked child must not use its parent's
/// sockets: the table is dropped (closing the child's copies only) when the pid changes.
struct Connections {
    pid: u32,
    streams: HashMap<Address, TcpStream>,
}

thread_local! {
    static CONNECTIONS: RefCell<Connections> = RefCell::new(Connections {
        pid: std::process::id(),
        streams: HashMap::new(),
    });
}

/// This thread's kept connection to `address` (taken out of the table while it is used), or None.
fn kept_connection(address: &Address) -> Option<TcpStream> {
    CONNECTIONS.with(|c| {
        let mut c = c.borrow_mut();
        if c.pid != std::process::id() {
            c.pid = std::process::id();
            c.streams.clear();
        }
        c.streams.remove(address)
    })
}

fn keep_connection(address: Address, stream: TcpStream) {
    CONNECTIONS.with(|c| {
        c.borrow_mut().streams.insert(address, stream);
    });
}

fn connect(address: &Address, timeouts: &Timeouts) -> Result<TcpStream, GetError> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in (address.0.as_str(), address.1).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeouts.wait(timeouts.connect)) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(err) => last = err,
        }
    }
    Err(last.into())
}

/// How an exchange failed.
pub(super) enum Failure {
    /// Before a byte of the answer came, by a reset or close: a stale keep-alive connection if it was
    /// reused (tried once more on a new one).
    Early(GetError),
    /// Anything else: the connection is dropped.
    Late(GetError),
    /// An error answer read to its end: the connection stays usable if `keep`.
    Answer(GetError, bool),
}

impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Self {
        Failure::Late(err.into())
    }
}

/// Fills `into` with the GET's bytes, on this thread's connection to the endpoint (made if there is
/// none; made once more if a kept-alive one turns out closed before answering).
pub fn get(signer: &Signer, get: &Get<'_>, into: &mut [u8]) -> Result<(), GetError> {
    if into.is_empty() {
        return Ok(());
    }
    let wire = request(signer, get, into.len());
    on_connection(&get.endpoint, &get.timeouts, |stream| {
        exchange(stream, &wire, get, into).map(|keep| ((), keep))
    })
}

/// Runs `exchange` (Ok((its result, keep the connection))) on this thread's connection to the endpoint:
/// made if there is none, made once more if a kept-alive one turns out closed before answering (S3
/// closes idle connections, which a thread only sees when it uses one). The connection goes back to
/// the table when the exchange says it can.
pub(super) fn on_connection<T>(
    endpoint: &Endpoint<'_>,
    timeouts: &Timeouts,
    mut exchange: impl FnMut(&mut TcpStream) -> Result<(T, bool), Failure>,
) -> Result<T, GetError> {
    let address: Address = (endpoint.connect_host.to_string(), endpoint.port);
    let kept = kept_connection(&address);
    let reused = kept.is_some();
    let mut stream = match kept {
        Some(stream) => stream,
        None => connect(&address, timeouts)?,
    };
    let mut outcome = exchange(&mut stream);
    if reused && matches!(outcome, Err(Failure::Early(_))) {
        stream = connect(&address, timeouts)?;
        outcome = exchange(&mut stream);
    }
    match outcome {
        Ok((result, keep)) => {
            if keep {
                keep_connection(address, stream);
            }
            Ok(result)
        }
        Err(Failure::Answer(err, keep)) => {
            if keep {
                keep_connection(address, stream);
            }
            Err(err)
        }
        Err(Failure::Early(err) | Failure::Late(err)) => Err(err),
    }
}

fn is_cut(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

pub(super) struct AnswerHead {
    pub(super) status: u16,
    pub(super) length: Option<usize>,
    pub(super) chunked: bool,
    /// The server closes the connection after this answer.
    pub(super) close: bool,
    pub(super) etag: Option<String>,
    /// As sent (RFC 7231's IMF-fixdate): a HEAD's object time.
    pub(super) last_modified: Option<String>,
}

pub(super) fn parse_head(text: &str) -> Result<AnswerHead, GetError> {
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let mut parts = first.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let status = parts
        .next()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    let status = match (
        version.starts_with("HTTP/1."),
        status.and_then(|s| s.parse().ok()),
    ) {
        (true, Some(status)) => status,
        _ => {
            let shown: String = first.chars().take(80).collect();
            return Err(GetError::NotHandled(format!(
                "not an HTTP/1.1 answer: {shown:?}"
            )));
        }
    };
    let mut head = AnswerHead {
        status,
        length: None,
        chunked: false,
        close: false,
        etag: None,
        last_modified: None,
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            head.length = value.parse().ok();
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            head.close = value.eq_ignore_ascii_case("close");
        } else if name.eq_ignore_ascii_case("etag") {
            head.etag = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("last-modified") {
            head.last_modified = Some(value.to_string());
        }
    }
    Ok(head)
}

/// Reads into `buf` from the stream, one wait of the read timeout (or what is left of the deadline).
pub(super) fn read_some(
    stream: &mut TcpStream,
    timeouts: &Timeouts,
    buf: &mut [u8],
) -> io::Result<usize> {
    stream.set_read_timeout(Some(timeouts.wait(timeouts.read)))?;
    loop {
        match stream.read(buf) {
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Sends the request and reads the answer's head: it and the bytes of the body that came with it.
pub(super) fn send_and_read_head(
    stream: &mut TcpStream,
    wire: &[u8],
    timeouts: &Timeouts,
) -> Result<(AnswerHead, Vec<u8>), Failure> {
    stream.set_write_timeout(Some(timeouts.wait(timeouts.read)))?;
    if let Err(err) = stream.write_all(wire) {
        return Err(if is_cut(&err) {
            Failure::Early(err.into())
        } else {
            Failure::Late(err.into())
        });
    }
    let mut head = vec![0u8; 16 << 10];
    let mut filled = 0;
    let end = loop {
        if filled == head.len() {
            if head.len() >= MAX_HEADER_BYTES {
                return Err(Failure::Late(GetError::NotHandled(
                    "answer headers too long".into(),
                )));
            }
            head.resize(head.len() * 2, 0);
        }
        let n = match read_some(stream, timeouts, &mut head[filled..]) {
            Ok(n) => n,
            Err(err) if filled == 0 && is_cut(&err) => return Err(Failure::Early(err.into())),
            Err(err) => return Err(err.into()),
        };
        if n == 0 {
            return Err(if filled == 0 {
                Failure::Early(errno(libc::ECONNRESET, "S3 closed the connection".into()))
            } else {
                Failure::Late(errno(
                    libc::ECONNRESET,
                    "S3 closed the connection mid-answer".into(),
                ))
            });
        }
        let from = filled.saturating_sub(3);
        filled += n;
        if let Some(at) = head[from..filled].windows(4).position(|w| w == b"\r\n\r\n") {
            break from + at;
        }
    };
    let answer = parse_head(&String::from_utf8_lossy(&head[..end])).map_err(Failure::Late)?;
    head.truncate(filled);
    head.drain(..end + 4);
    Ok((answer, head))
}

/// Sends the GET and reads the answer, its body into `into`. Ok(keep the connection).
fn exchange(
    stream: &mut TcpStream,
    wire: &[u8],
    get: &Get<'_>,
    into: &mut [u8],
) -> Result<bool, Failure> {
    let timeouts = &get.timeouts;
    let (answer, early) = send_and_read_head(stream, wire, timeouts)?;
    let early = early.as_slice();
    let length = match (answer.length, answer.chunked) {
        (Some(length), false) => length,
        _ => {
            return Err(Failure::Late(GetError::NotHandled(
                "answer without a Content-Length".into(),
            )));
        }
    };
    if answer.status != 200 && answer.status != 206 {
        return Err(error_answer(stream, timeouts, &answer, length, early));
    }
    if answer.status == 200 && length != into.len() {
        return Err(Failure::Late(GetError::NotHandled(
            "the server ignored the Range header".into(),
        )));
    }
    if length != into.len() {
        return Err(Failure::Late(errno(
            libc::EIO,
            format!("short read: {length} of {} bytes", into.len()),
        )));
    }
    if early.len() > length {
        return Err(Failure::Late(errno(
            libc::EIO,
            format!("an answer longer than its Content-Length ({length} bytes)"),
        )));
    }
    into[..early.len()].copy_from_slice(early);
    let mut got = early.len();
    while got < length {
        let n = read_some(stream, timeouts, &mut into[got..])?;
        if n == 0 {
            return Err(Failure::Late(errno(
                libc::ECONNRESET,
                format!("S3 closed the connection after {got} of {length} bytes"),
            )));
        }
        got += n;
    }
    if let (Some(wanted), Some(found)) = (get.etag, &answer.etag)
        && wanted != found
    {
        return Err(Failure::Answer(GetError::Changed, !answer.close));
    }
    Ok(!answer.close)
}

/// An error answer's body (up to MAX_ERROR_BODY), read to its end when it is that short.
fn error_answer(
    stream: &mut TcpStream,
    timeouts: &Timeouts,
    answer: &AnswerHead,
    length: usize,
    early: &[u8],
) -> Failure {
    if length > MAX_ERROR_BODY {
        return Failure::Late(GetError::NotHandled("error answer too long".into()));
    }
    let mut body = early[..early.len().min(length)].to_vec();
    let mut chunk = [0u8; 8192];
    while body.len() < length {
        let room = (length - body.len()).min(chunk.len());
        match read_some(stream, timeouts, &mut chunk[..room]) {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let whole = body.len() == length && early.len() <= length;
    let err = GetError::Answer {
        status: answer.status,
        body,
    };
    if whole {
        Failure::Answer(err, !answer.close)
    } else {
        Failure::Late(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amz_dates() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(1_709_251_199), "20240229T235959Z");
    }

    #[test]
    fn keys_are_encoded_as_sigv4_wants() {
        assert_eq!(uri_encode("a b/c~d+é", true), "a%20b/c~d%2B%C3%A9");
        assert_eq!(uri_encode("v/1", false), "v%2F1");
    }

    /// AWS's documented example (GET Object, "Example: GET Object" in the SigV4 for S3 reference).
    #[test]
    fn the_documented_signature() {
        let signer = Signer::new("us-east-1");
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE",
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            token: None,
        };
        let mut headers = vec![("range".to_string(), "bytes=0-9".to_string())];
        signer.sign(
            "GET",
            &creds,
            "examplebucket.s3.amazonaws.com",
            "/test.txt",
            "",
            &mut headers,
            "20130524T000000Z",
        );
        let authorization = &headers.last().unwrap().1;
        assert!(authorization.ends_with(
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        ));
    }

    /// AWS's documented example with a query of two parameters ("Example: GET Bucket (List Objects)"):
    /// given out of order, they are signed sorted by name.
    #[test]
    fn the_documented_signature_of_a_query() {
        let signer = Signer::new("us-east-1");
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE",
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            token: None,
        };
        let query = canonical_query(&[("prefix", "J"), ("max-keys", "2")]);
        assert_eq!(query, "max-keys=2&prefix=J");
        let mut headers = Vec::new();
        signer.sign(
            "GET",
            &creds,
            "examplebucket.s3.amazonaws.com",
            "/",
            &query,
            &mut headers,
            "20130524T000000Z",
        );
        let authorization = &headers.last().unwrap().1;
        assert!(authorization.ends_with(
            "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
        ));
    }

    #[test]
    fn queries_are_sorted_and_encoded() {
        assert_eq!(
            canonical_query(&[
                ("prefix", "a b/é"),
                ("list-type", "2"),
                ("continuation-token", "1/x+y=="),
                ("delimiter", "/"),
            ]),
            "continuation-token=1%2Fx%2By%3D%3D&delimiter=%2F&list-type=2&prefix=a%20b%2F%C3%A9"
        );
        assert_eq!(canonical_query(&[]), "");
    }

    #[test]
    fn heads_parse_and_non_http_is_not_handled() {
        let head = parse_head(
            "HTTP/1.1 206 Partial\r\nContent-Length: 10\r\nETag: \"x\"\r\nConnection: close",
        )
        .unwrap();
        assert_eq!(
            (head.status, head.length, head.close),
            (206, Some(10), true)
        );
        assert_eq!(head.etag.as_deref(), Some("\"x\""));
        assert!(matches!(
            parse_head("SSH-2.0-OpenSSH"),
            Err(GetError::NotHandled(_))
        ));
    }
}
