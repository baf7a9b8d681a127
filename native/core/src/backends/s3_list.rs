//! S3 listings (ListObjectsV2) and HEADs: what a directory holds and what one object is, the metadata a
//! mount serves. They go on s3_get.rs's connections (the same keep-alive table per OS thread, the same
//! SigV4 signer and answer-head parsing), blocking, plain http, every wait within the caller's timeouts.
//!
//! A listing's body is XML, read whole (by its Content-Length or its chunks: SeaweedFS and proxies may
//! chunk it; at most MAX_BODY) and parsed with quick-xml's reader, entities decoded. As with a GET, an
//! error answer comes back as its status and body for Python to name; a HEAD's 404 is no object, not an
//! error.

use std::net::TcpStream;

use quick_xml::escape::resolve_predefined_entity;
use quick_xml::events::{BytesRef, Event};
use quick_xml::reader::Reader;

use super::s3_get::{
    AnswerHead, Credentials, Endpoint, Failure, GetError, Signer, Timeouts, canonical_query, errno,
    on_connection, read_some, request_bytes, send_and_read_head, uri_encode,
};

/// A listing (or error) body longer than this is not S3's: 1000 keys of 1 KiB, escaped, stay below.
const MAX_BODY: usize = 16 << 20;
/// A chunk-size line or a trailer longer than this is not HTTP this client understands.
const MAX_LINE: usize = 8 << 10;
/// How much one read from the connection asks for.
const READ_SIZE: usize = 64 << 10;

/// One object of a listing or a HEAD. `etag` as S3 sends it, quotes included (a GET's If-Match wants it
/// so).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub etag: String,
    /// Seconds since the epoch; 0 if S3's time could not be read.
    pub mtime_secs: i64,
}

/// A listing: its objects and common prefixes (full keys), and where the next page starts if any.
#[derive(Debug, Default)]
pub struct ListPage {
    pub objects: Vec<ObjectInfo>,
    pub prefixes: Vec<String>,
    /// The continuation token of the next page; None on the last one.
    pub next: Option<String>,
}

/// One ListObjectsV2 request: the keys under `prefix`, rolled up at `delimiter` into common prefixes.
pub struct List<'a> {
    pub endpoint: Endpoint<'a>,
    pub prefix: &'a str,
    pub delimiter: Option<&'a str>,
    /// A previous page's `next`.
    pub continuation: Option<&'a str>,
    /// At most this many keys and prefixes per page; 0 leaves it to the server (1000 for S3).
    pub max_keys: u32,
    pub credentials: Option<Credentials<'a>>,
    pub timeouts: Timeouts,
}

/// One HEAD of `key`.
pub struct Head<'a> {
    pub endpoint: Endpoint<'a>,
    pub key: &'a str,
    pub credentials: Option<Credentials<'a>>,
    pub timeouts: Timeouts,
}

/// One page of ListObjectsV2 (list-type=2). Keys and prefixes are full keys, XML entities decoded.
pub fn list_page(signer: &Signer, list: &List<'_>) -> Result<ListPage, GetError> {
    fetch_page(signer, list, list.continuation)
}

/// Every page (following NextContinuationToken while IsTruncated), objects and common prefixes
/// together; `next` is None in the result.
pub fn list_all(signer: &Signer, list: &List<'_>) -> Result<ListPage, GetError> {
    let mut all = ListPage::default();
    let mut token = list.continuation.map(str::to_string);
    loop {
        let page = fetch_page(signer, list, token.as_deref())?;
        all.objects.extend(page.objects);
        all.prefixes.extend(page.prefixes);
        match page.next {
            None => return Ok(all),
            // (a server that hands the same token back would have us list forever)
            Some(next) if token.as_deref() == Some(next.as_str()) => {
                return Err(GetError::NotHandled(
                    "the listing's continuation token does not advance".into(),
                ));
            }
            next => token = next,
        }
    }
}

/// The object's size, ETag and Last-Modified; Ok(None) if there is no such key (404). Other errors as
/// GetError.
pub fn head(signer: &Signer, head: &Head<'_>) -> Result<Option<ObjectInfo>, GetError> {
    let path = format!(
        "{}{}",
        head.endpoint.path_prefix,
        uri_encode(head.key, true)
    );
    let wire = request_bytes(
        signer,
        "HEAD",
        &head.endpoint,
        &path,
        "",
        Vec::new(),
        head.credentials.as_ref(),
    );
    on_connection(&head.endpoint, &head.timeouts, |stream| {
        head_exchange(stream, &wire, head)
    })
}

/// The page that `continuation` starts (the first one without).
fn fetch_page(
    signer: &Signer,
    list: &List<'_>,
    continuation: Option<&str>,
) -> Result<ListPage, GetError> {
    let max_keys = list.max_keys.to_string();
    let mut params = vec![("list-type", "2")];
    if !list.prefix.is_empty() {
        params.push(("prefix", list.prefix));
    }
    if let Some(delimiter) = list.delimiter {
        params.push(("delimiter", delimiter));
    }
    if let Some(token) = continuation {
        params.push(("continuation-token", token));
    }
    if list.max_keys > 0 {
        params.push(("max-keys", &max_keys));
    }
    let wire = request_bytes(
        signer,
        "GET",
        &list.endpoint,
        list.endpoint.path_prefix,
        &canonical_query(&params),
        Vec::new(),
        list.credentials.as_ref(),
    );
    let body = on_connection(&list.endpoint, &list.timeouts, |stream| {
        list_exchange(stream, &wire, &list.timeouts)
    })?;
    parse_listing(&body)
}

/// Sends the LIST and reads its answer whole: Ok((the body of a 2xx, keep the connection)).
fn list_exchange(
    stream: &mut TcpStream,
    wire: &[u8],
    timeouts: &Timeouts,
) -> Result<(Vec<u8>, bool), Failure> {
    let (answer, early) = send_and_read_head(stream, wire, timeouts)?;
    if (300..400).contains(&answer.status) {
        return Err(redirect(answer.status));
    }
    let (body, keep) = read_body(stream, timeouts, &answer, early)?;
    if (200..300).contains(&answer.status) {
        Ok((body, keep))
    } else {
        let status = answer.status;
        Err(Failure::Answer(GetError::Answer { status, body }, keep))
    }
}

/// Sends the HEAD and reads its answer: Ok((the object, or None for a 404; keep the connection)).
fn head_exchange(
    stream: &mut TcpStream,
    wire: &[u8],
    head: &Head<'_>,
) -> Result<(Option<ObjectInfo>, bool), Failure> {
    let (answer, early) = send_and_read_head(stream, wire, &head.timeouts)?;
    // A HEAD's answer ends with its head whatever its Content-Length says: bytes after it are not HTTP
    // this client understands, and the connection is not used again.
    let keep = !answer.close && early.is_empty();
    match answer.status {
        200..=299 => {
            let Some(size) = answer.length else {
                return Err(not_understood("a HEAD answer without a Content-Length"));
            };
            let object = ObjectInfo {
                key: head.key.to_string(),
                size: size as u64,
                etag: answer.etag.unwrap_or_default(),
                mtime_secs: answer.last_modified.as_deref().map_or(0, http_date_secs),
            };
            Ok((Some(object), keep))
        }
        404 => Ok((None, keep)),
        300..=399 => Err(redirect(answer.status)),
        status => Err(Failure::Answer(
            GetError::Answer {
                status,
                body: Vec::new(),
            },
            keep,
        )),
    }
}

/// A redirect (another region, another endpoint) is for botocore to follow.
fn redirect(status: u16) -> Failure {
    Failure::Late(GetError::NotHandled(format!("a redirect ({status})")))
}

fn not_understood(what: &str) -> Failure {
    Failure::Late(GetError::NotHandled(what.to_string()))
}

fn too_long() -> Failure {
    not_understood("an answer body longer than 16 MiB")
}

/// The answer's body, whole (at most MAX_BODY): by its chunks, by its Content-Length or, with neither,
/// up to the connection's close. Ok((body, keep the connection)): kept when the body ended where the
/// answer said and nothing came after it.
fn read_body(
    stream: &mut TcpStream,
    timeouts: &Timeouts,
    answer: &AnswerHead,
    early: Vec<u8>,
) -> Result<(Vec<u8>, bool), Failure> {
    let mut incoming = Incoming {
        stream,
        timeouts,
        pending: early,
        at: 0,
    };
    let body = if answer.chunked {
        incoming.chunks()?
    } else if let Some(length) = answer.length {
        if length > MAX_BODY {
            return Err(too_long());
        }
        let mut body = Vec::with_capacity(length);
        incoming.exactly(length, &mut body)?;
        body
    } else {
        return Ok((incoming.until_close()?, false));
    };
    Ok((body, !answer.close && incoming.rest().is_empty()))
}

/// An answer's bytes as they come, those already read (`pending[at..]`) first.
struct Incoming<'s> {
    stream: &'s mut TcpStream,
    timeouts: &'s Timeouts,
    pending: Vec<u8>,
    at: usize,
}

impl Incoming<'_> {
    fn rest(&self) -> &[u8] {
        &self.pending[self.at..]
    }

    /// Reads what the connection has next into `pending`: Ok(0) at its close.
    fn read_more(&mut self) -> Result<usize, Failure> {
        self.pending.drain(..self.at);
        self.at = 0;
        let had = self.pending.len();
        self.pending.resize(had + READ_SIZE, 0);
        let read = read_some(self.stream, self.timeouts, &mut self.pending[had..]);
        self.pending.truncate(had + read.as_ref().map_or(0, |n| *n));
        read.map_err(Failure::from)
    }

    /// read_more where the connection's close cuts the answer short.
    fn more(&mut self) -> Result<(), Failure> {
        if self.read_more()? == 0 {
            return Err(Failure::Late(errno(
                libc::ECONNRESET,
                "S3 closed the connection mid-answer".into(),
            )));
        }
        Ok(())
    }

    /// The next `length` bytes, onto `into`.
    fn exactly(&mut self, length: usize, into: &mut Vec<u8>) -> Result<(), Failure> {
        let mut left = length;
        loop {
            let take = self.rest().len().min(left);
            into.extend_from_slice(&self.rest()[..take]);
            self.at += take;
            left -= take;
            if left == 0 {
                return Ok(());
            }
            self.more()?;
        }
    }

    /// The next line, without its CRLF: a chunk's size, a trailer.
    fn line(&mut self) -> Result<Vec<u8>, Failure> {
        let mut searched = 0;
        loop {
            let rest = self.rest();
            if let Some(at) = rest[searched..].windows(2).position(|w| w == b"\r\n") {
                let line = rest[..searched + at].to_vec();
                self.at += searched + at + 2;
                return Ok(line);
            }
            if rest.len() > MAX_LINE {
                return Err(not_understood("a chunked answer's line too long"));
            }
            searched = rest.len().saturating_sub(1);
            self.more()?;
        }
    }

    /// A chunked body's chunks, together (the trailers, read, are dropped).
    fn chunks(&mut self) -> Result<Vec<u8>, Failure> {
        let mut body = Vec::new();
        loop {
            let size = chunk_size(&self.line()?)
                .ok_or_else(|| not_understood("a chunked answer's bad chunk size"))?;
            if size == 0 {
                break;
            }
            if size > MAX_BODY - body.len() {
                return Err(too_long());
            }
            self.exactly(size, &mut body)?;
            if !self.line()?.is_empty() {
                return Err(not_understood("a chunk longer than its size"));
            }
        }
        while !self.line()?.is_empty() {}
        Ok(body)
    }

    /// Everything up to the connection's close.
    fn until_close(&mut self) -> Result<Vec<u8>, Failure> {
        let mut body = Vec::new();
        loop {
            body.extend_from_slice(self.rest());
            self.at = self.pending.len();
            if body.len() > MAX_BODY {
                return Err(too_long());
            }
            if self.read_more()? == 0 {
                return Ok(body);
            }
        }
    }
}

/// A chunk-size line's size (hex digits, then perhaps `;extensions`).
fn chunk_size(line: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(line).ok()?;
    let digits = text.split(';').next()?.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    usize::from_str_radix(digits, 16).ok()
}

fn bad_listing(what: impl std::fmt::Display) -> GetError {
    GetError::NotHandled(format!("not a listing S3 sends: {what}"))
}

/// A Contents element as it is read.
#[derive(Default)]
struct ObjectFields {
    key: Option<String>,
    size: Option<u64>,
    etag: String,
    mtime_secs: i64,
}

/// What the elements read so far of a ListBucketResult say.
#[derive(Default)]
struct Listing {
    /// The open elements' local names, the root first.
    path: Vec<Vec<u8>>,
    /// The text (entities decoded) of the innermost open element since it opened.
    text: String,
    object: ObjectFields,
    page: ListPage,
    truncated: bool,
    token: Option<String>,
}

impl Listing {
    fn open(&mut self, name: &[u8]) -> Result<(), GetError> {
        if self.path.is_empty() && name != b"ListBucketResult" {
            return Err(bad_listing(format!(
                "its root is {:?}",
                String::from_utf8_lossy(name)
            )));
        }
        self.path.push(name.to_vec());
        self.text.clear();
        Ok(())
    }

    /// The innermost open element ends: what it says goes where it belongs.
    fn close(&mut self) -> Result<(), GetError> {
        let path: Vec<&[u8]> = self.path.iter().map(Vec::as_slice).collect();
        let text = std::mem::take(&mut self.text);
        match path.as_slice() {
            [b"ListBucketResult", b"Contents", b"Key"] => self.object.key = Some(text),
            [b"ListBucketResult", b"Contents", b"Size"] => {
                let size = text.trim().parse().map_err(|_| bad_listing("a Size"))?;
                self.object.size = Some(size);
            }
            [b"ListBucketResult", b"Contents", b"ETag"] => self.object.etag = text,
            [b"ListBucketResult", b"Contents", b"LastModified"] => {
                self.object.mtime_secs = iso8601_secs(&text);
            }
            [b"ListBucketResult", b"Contents"] => {
                let fields = std::mem::take(&mut self.object);
                let (Some(key), Some(size)) = (fields.key, fields.size) else {
                    return Err(bad_listing("a Contents without its Key or Size"));
                };
                self.page.objects.push(ObjectInfo {
                    key,
                    size,
                    etag: fields.etag,
                    mtime_secs: fields.mtime_secs,
                });
            }
            [b"ListBucketResult", b"CommonPrefixes", b"Prefix"] => self.page.prefixes.push(text),
            [b"ListBucketResult", b"IsTruncated"] => self.truncated = text.trim() == "true",
            [b"ListBucketResult", b"NextContinuationToken"] => {
                self.token = Some(text).filter(|token| !token.is_empty());
            }
            _ => {}
        }
        self.path.pop();
        Ok(())
    }

    /// An entity or character reference, decoded onto the text.
    fn reference(&mut self, reference: &BytesRef<'_>) -> Result<(), GetError> {
        if let Some(character) = reference.resolve_char_ref().map_err(bad_listing)? {
            self.text.push(character);
            return Ok(());
        }
        let name = reference.decode().map_err(bad_listing)?;
        let value = resolve_predefined_entity(&name)
            .ok_or_else(|| bad_listing(format!("an unknown entity &{name};")))?;
        self.text.push_str(value);
        Ok(())
    }
}

/// A ListBucketResult's objects, common prefixes and (if it is truncated) continuation token.
fn parse_listing(body: &[u8]) -> Result<ListPage, GetError> {
    let mut reader = Reader::from_reader(body);
    let mut listing = Listing::default();
    let mut saw_root = false;
    loop {
        match reader.read_event().map_err(bad_listing)? {
            Event::Start(start) => {
                listing.open(start.local_name().as_ref())?;
                saw_root = true;
            }
            Event::Empty(start) => {
                listing.open(start.local_name().as_ref())?;
                saw_root = true;
                listing.close()?;
            }
            Event::End(_) => listing.close()?,
            Event::Text(text) => listing
                .text
                .push_str(&text.xml10_content().map_err(bad_listing)?),
            Event::CData(data) => listing
                .text
                .push_str(&data.xml10_content().map_err(bad_listing)?),
            Event::GeneralRef(reference) => listing.reference(&reference)?,
            Event::Eof => break,
            _ => {}
        }
    }
    if !saw_root || !listing.path.is_empty() {
        return Err(bad_listing("no whole ListBucketResult"));
    }
    let mut page = listing.page;
    if listing.truncated {
        page.next =
            Some(listing.token.ok_or_else(|| {
                bad_listing("a truncated listing without a NextContinuationToken")
            })?);
    }
    Ok(page)
}

/// Seconds since the epoch of a listing's LastModified, ISO 8601 in UTC (`2026-11-28T20:00:00.000Z`); 0
/// if it is not that.
fn iso8601_secs(text: &str) -> i64 {
    let parse = || {
        let (date, time) = text.trim().split_once('T')?;
        let mut date = date.split('-');
        let (year, month, day) = (date.next()?, date.next()?, date.next()?);
        let time = time.strip_suffix('Z')?;
        let (time, fraction) = time.split_once('.').unwrap_or((time, "0"));
        number(fraction)?;
        let (hour, minute, second) = clock(time)?;
        if date.next().is_some() {
            return None;
        }
        civil_secs(
            number(year)?,
            number(month)?,
            number(day)?,
            hour,
            minute,
            second,
        )
    };
    parse().unwrap_or(0)
}

/// Seconds since the epoch of an HTTP date (RFC 7231's IMF-fixdate, `Sat, 28 Nov 2026 20:00:00 GMT`,
/// what S3 sends as Last-Modified); 0 if it is not that.
fn http_date_secs(text: &str) -> i64 {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let parse = || {
        let mut parts = text.split_whitespace();
        parts.next()?.strip_suffix(',')?; // the day of the week, which the date says again
        let day = number(parts.next()?)?;
        let month_name = parts.next()?;
        let month = MONTHS
            .iter()
            .position(|m| m.eq_ignore_ascii_case(month_name))? as i64
            + 1;
        let year = number(parts.next()?)?;
        let (hour, minute, second) = clock(parts.next()?)?;
        if parts.next()? != "GMT" || parts.next().is_some() {
            return None;
        }
        civil_secs(year, month, day, hour, minute, second)
    };
    parse().unwrap_or(0)
}

/// Decimal digits only (no sign, no spaces).
fn number(text: &str) -> Option<i64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// HH:MM:SS.
fn clock(text: &str) -> Option<(i64, i64, i64)> {
    let mut parts = text.split(':');
    let time = (
        number(parts.next()?)?,
        number(parts.next()?)?,
        number(parts.next()?)?,
    );
    parts.next().is_none().then_some(time)
}

/// Seconds since the epoch of a UTC civil time (days from a civil date: Howard Hinnant's algorithm,
/// the inverse of s3_get's amz_date).
fn civil_secs(year: i64, month: i64, day: i64, hour: i64, minute: i64, second: i64) -> Option<i64> {
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
        || year > 1_000_000
    {
        return None;
    }
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1; // from March 1st
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(days * 86_400 + hour * 3600 + minute * 60 + second)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// One canned answer, and whether the server then closes the connection (without saying so in
    /// the answer, as an idle S3 connection is closed).
    struct Canned {
        bytes: Vec<u8>,
        then_close: bool,
    }

    fn answer(bytes: impl AsRef<[u8]>) -> Canned {
        Canned {
            bytes: bytes.as_ref().to_vec(),
            then_close: false,
        }
    }

    /// An answer with a Content-Length body.
    fn answer_with_body(status: &str, body: &str) -> Canned {
        answer(format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ))
    }

    /// A server on 127.0.0.1 answering each request (its head) with the next canned answer, on
    /// whatever connection it comes; it records the requests and counts the connections it accepts.
    struct CannedServer {
        port: u16,
        thread: JoinHandle<(Vec<String>, usize)>,
    }

    impl CannedServer {
        fn start(answers: Vec<Canned>) -> CannedServer {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let thread = std::thread::spawn(move || {
                let (mut requests, mut accepts) = (Vec::new(), 0);
                let mut answers = answers.into_iter().peekable();
                while answers.peek().is_some() {
                    let (mut connection, _) = listener.accept().unwrap();
                    accepts += 1;
                    connection
                        .set_read_timeout(Some(Duration::from_secs(10)))
                        .unwrap();
                    while let Some(request) = read_request(&mut connection) {
                        requests.push(request);
                        let Some(canned) = answers.next() else { break };
                        connection.write_all(&canned.bytes).unwrap();
                        if canned.then_close || answers.peek().is_none() {
                            break;
                        }
                    }
                }
                (requests, accepts)
            });
            CannedServer { port, thread }
        }

        fn endpoint(&self) -> Endpoint<'static> {
            Endpoint {
                host: "bucket.test",
                connect_host: "127.0.0.1",
                port: self.port,
                path_prefix: "/bucket/",
            }
        }

        /// The requests' heads and the number of connections, once every answer went out.
        fn finish(self) -> (Vec<String>, usize) {
            self.thread.join().unwrap()
        }
    }

    /// A request's head (requests here have no body), or None when the client closed.
    fn read_request(connection: &mut TcpStream) -> Option<String> {
        let mut request = Vec::new();
        let mut byte = [0u8; 1];
        while !request.ends_with(b"\r\n\r\n") {
            match connection.read(&mut byte) {
                Ok(1) => request.push(byte[0]),
                _ => return None,
            }
        }
        Some(String::from_utf8(request).unwrap())
    }

    fn timeouts() -> Timeouts {
        Timeouts {
            connect: Duration::from_secs(5),
            read: Duration::from_secs(5),
            deadline: None,
        }
    }

    fn credentials() -> Option<Credentials<'static>> {
        Some(Credentials {
            access_key: "AKIDEXAMPLE",
            secret_key: "secret",
            token: Some("session"),
        })
    }

    fn listing<'a>(server: &CannedServer, prefix: &'a str, max_keys: u32) -> List<'a> {
        List {
            endpoint: server.endpoint(),
            prefix,
            delimiter: Some("/"),
            continuation: None,
            max_keys,
            credentials: credentials(),
            timeouts: timeouts(),
        }
    }

    fn head_of<'a>(server: &CannedServer, key: &'a str) -> Head<'a> {
        Head {
            endpoint: server.endpoint(),
            key,
            credentials: None,
            timeouts: timeouts(),
        }
    }

    fn request_line(request: &str) -> &str {
        request.split("\r\n").next().unwrap()
    }

    const PAGE_ONE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name><Prefix>dir/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys><Delimiter>/</Delimiter><IsTruncated>true</IsTruncated><NextContinuationToken>1/tok+en==</NextContinuationToken><Contents><Key>dir/a.txt</Key><LastModified>2026-11-28T20:00:00.000Z</LastModified><ETag>"aaa"</ETag><Size>10</Size><StorageClass>STANDARD</StorageClass></Contents><CommonPrefixes><Prefix>dir/sub/</Prefix></CommonPrefixes></ListBucketResult>"#;

    const PAGE_TWO: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bucket</Name>
  <Prefix>dir/</Prefix>
  <ContinuationToken>1/tok+en==</ContinuationToken>
  <IsTruncated>false</IsTruncated>
  <Contents>
    <Key>dir/b.bin</Key>
    <LastModified>2026-11-28T20:00:01Z</LastModified>
    <ETag>&quot;bbb-2&quot;</ETag>
    <Size>5368709120</Size>
  </Contents>
</ListBucketResult>"#;

    #[test]
    fn all_pages_follow_the_continuation_token_on_one_connection() {
        let server = CannedServer::start(vec![
            answer_with_body("200 OK", PAGE_ONE),
            answer_with_body("200 OK", PAGE_TWO),
        ]);
        let signer = Signer::new("us-east-1");
        let page = list_all(&signer, &listing(&server, "dir/", 2)).unwrap();
        assert_eq!(
            page.objects,
            vec![
                ObjectInfo {
                    key: "dir/a.txt".into(),
                    size: 10,
                    etag: "\"aaa\"".into(),
                    mtime_secs: 1_795_896_000,
                },
                ObjectInfo {
                    key: "dir/b.bin".into(),
                    size: 5_368_709_120,
                    etag: "\"bbb-2\"".into(),
                    mtime_secs: 1_795_896_001,
                },
            ]
        );
        assert_eq!(page.prefixes, vec!["dir/sub/".to_string()]);
        assert_eq!(page.next, None);
        let (requests, accepts) = server.finish();
        assert_eq!(accepts, 1);
        assert_eq!(
            request_line(&requests[0]),
            "GET /bucket/?delimiter=%2F&list-type=2&max-keys=2&prefix=dir%2F HTTP/1.1"
        );
        assert_eq!(
            request_line(&requests[1]),
            "GET /bucket/?continuation-token=1%2Ftok%2Ben%3D%3D&delimiter=%2F&list-type=2\
             &max-keys=2&prefix=dir%2F HTTP/1.1"
        );
        for request in &requests {
            assert!(request.contains("\r\nHost: bucket.test\r\n"));
            assert!(
                request.contains("\r\nauthorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
            );
            assert!(request.contains("\r\nx-amz-security-token: session\r\n"));
        }
    }

    #[test]
    fn one_page_says_where_the_next_starts() {
        let server = CannedServer::start(vec![answer_with_body("200 OK", PAGE_ONE)]);
        let signer = Signer::new("us-east-1");
        let list = List {
            continuation: Some("0"),
            ..listing(&server, "", 0)
        };
        let page = list_page(&signer, &list).unwrap();
        assert_eq!(page.objects.len(), 1);
        assert_eq!(page.next.as_deref(), Some("1/tok+en=="));
        let (requests, _) = server.finish();
        // No prefix and no max-keys when they are left to the server.
        assert_eq!(
            request_line(&requests[0]),
            "GET /bucket/?continuation-token=0&delimiter=%2F&list-type=2 HTTP/1.1"
        );
    }

    #[test]
    fn chunked_listings_with_escaped_keys() {
        let xml = "<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>false</IsTruncated>\
            <Contents><Key>a&amp;b.txt</Key><Size>1</Size><ETag>&quot;abc&quot;</ETag>\
            <LastModified>nonsense</LastModified></Contents>\
            <Contents><Key>caf&#233; &lt;1&gt; &#x263A;&apos;s</Key><Size>0</Size></Contents>\
            <CommonPrefixes><Prefix>x &amp; y/</Prefix></CommonPrefixes>\
            <CommonPrefixes><Prefix><![CDATA[<z>/]]></Prefix></CommonPrefixes></ListBucketResult>";
        // Chunks cut mid-entity, one with an extension, and a trailer.
        let mut body = String::new();
        for (n, piece) in [&xml[..40], &xml[40..101], &xml[101..]].iter().enumerate() {
            let extension = if n == 1 { ";name=value" } else { "" };
            body.push_str(&format!("{:x}{extension}\r\n{piece}\r\n", piece.len()));
        }
        body.push_str("0\r\nx-trailer: 1\r\n\r\n");
        let server = CannedServer::start(vec![
            answer(format!(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
            )),
            answer("HTTP/1.1 404 Not Found\r\n\r\n"),
        ]);
        let signer = Signer::new("us-east-1");
        let page = list_page(&signer, &listing(&server, "", 1000)).unwrap();
        let keys: Vec<&str> = page.objects.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(keys, ["a&b.txt", "café <1> ☺'s"]);
        assert_eq!(page.objects[0].etag, "\"abc\"");
        assert_eq!(page.objects[0].mtime_secs, 0);
        assert_eq!(page.objects[1].etag, "");
        assert_eq!(page.prefixes, ["x & y/", "<z>/"]);
        assert_eq!(page.next, None);
        // The chunked answer was read to its end: the next call goes on the same connection.
        assert_eq!(head(&signer, &head_of(&server, "gone")).unwrap(), None);
        assert_eq!(server.finish().1, 1);
    }

    #[test]
    fn heads_give_the_object_or_none_on_one_connection() {
        let server = CannedServer::start(vec![
            // A HEAD's answer has no body whatever its Content-Length says.
            answer(
                "HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nETag: \"0123abc\"\r\n\
                 Last-Modified: Sat, 28 Nov 2026 20:00:00 GMT\r\n\r\n",
            ),
            answer("HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\n\r\n"),
        ]);
        let signer = Signer::new("us-east-1");
        let found = head(&signer, &head_of(&server, "dir/a b+.txt")).unwrap();
        assert_eq!(
            found,
            Some(ObjectInfo {
                key: "dir/a b+.txt".into(),
                size: 1234,
                etag: "\"0123abc\"".into(),
                mtime_secs: 1_795_896_000,
            })
        );
        assert_eq!(head(&signer, &head_of(&server, "dir/none")).unwrap(), None);
        let (requests, accepts) = server.finish();
        assert_eq!(accepts, 1);
        assert_eq!(
            request_line(&requests[0]),
            "HEAD /bucket/dir/a%20b%2B.txt HTTP/1.1"
        );
        assert!(!requests[0].contains("authorization"));
    }

    #[test]
    fn error_answers_come_back_with_their_body() {
        let error = "<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code></Error>";
        let server = CannedServer::start(vec![
            answer_with_body("403 Forbidden", error),
            answer("HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"),
            answer_with_body("301 Moved Permanently", ""),
        ]);
        let signer = Signer::new("us-east-1");
        match list_page(&signer, &listing(&server, "", 0)) {
            Err(GetError::Answer { status: 403, body }) => assert_eq!(body, error.as_bytes()),
            other => panic!("not the 403: {other:?}"),
        }
        match head(&signer, &head_of(&server, "k")) {
            Err(GetError::Answer { status: 403, body }) => assert!(body.is_empty()),
            other => panic!("not the 403: {other:?}"),
        }
        assert!(matches!(
            list_page(&signer, &listing(&server, "", 0)),
            Err(GetError::NotHandled(_))
        ));
        // The error answers were read to their end: one connection.
        assert_eq!(server.finish().1, 1);
    }

    #[test]
    fn a_kept_connection_the_server_closed_is_made_anew() {
        let found = "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nETag: \"e\"\r\n\r\n";
        let server = CannedServer::start(vec![
            Canned {
                then_close: true,
                ..answer(found)
            },
            answer(found),
        ]);
        let signer = Signer::new("us-east-1");
        for _ in 0..2 {
            let object = head(&signer, &head_of(&server, "k")).unwrap().unwrap();
            assert_eq!((object.size, object.mtime_secs), (1, 0));
        }
        let (requests, accepts) = server.finish();
        assert_eq!((requests.len(), accepts), (2, 2));
    }

    #[test]
    fn listings_s3_does_not_send_are_not_handled() {
        for body in [
            "",
            "<Error><Code>x</Code></Error>",
            "<ListBucketResult><Contents><Key>k</Key></Contents></ListBucketResult>",
            "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
            "<ListBucketResult><Contents><Key>&bogus;</Key>",
            "<ListBucketResult><Contents><Key>a</Key><Size>-1</Size></Contents></ListBucketResult>",
        ] {
            assert!(
                matches!(parse_listing(body.as_bytes()), Err(GetError::NotHandled(_))),
                "{body:?}"
            );
        }
        let empty = parse_listing(b"<ListBucketResult/>").unwrap();
        assert!(empty.objects.is_empty() && empty.prefixes.is_empty() && empty.next.is_none());
    }

    #[test]
    fn chunk_sizes() {
        assert_eq!(chunk_size(b"1a"), Some(26));
        assert_eq!(chunk_size(b"FF;ext=1"), Some(255));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b""), None);
        assert_eq!(chunk_size(b"+1"), None);
        assert_eq!(chunk_size(b"zz"), None);
    }

    #[test]
    fn listing_times() {
        assert_eq!(iso8601_secs("2026-11-28T20:00:00.000Z"), 1_795_896_000);
        assert_eq!(iso8601_secs("2026-11-28T20:00:00Z"), 1_795_896_000);
        assert_eq!(iso8601_secs("1970-01-01T00:00:00.000Z"), 0);
        assert_eq!(iso8601_secs("2024-02-29T23:59:59.999Z"), 1_709_251_199);
        assert_eq!(iso8601_secs("2000-03-01T00:00:00Z"), 951_868_800);
        assert_eq!(iso8601_secs("1969-12-31T23:59:59Z"), -1);
        for bad in [
            "",
            "2026-11-28",
            "2026-11-28T20:00:00",
            "2026-13-28T20:00:00Z",
            "2026-11-28T20:00:00+01:00",
            "2026-11-28-1T20:00:00Z",
            "2026-11-28T20:00Z",
        ] {
            assert_eq!(iso8601_secs(bad), 0, "{bad:?}");
        }
    }

    #[test]
    fn http_dates() {
        assert_eq!(
            http_date_secs("Sat, 28 Nov 2026 20:00:00 GMT"),
            1_795_896_000
        );
        assert_eq!(
            http_date_secs("Thu, 29 Feb 2024 23:59:59 GMT"),
            1_709_251_199
        );
        assert_eq!(http_date_secs("Thu, 01 Jan 1970 00:00:00 GMT"), 0);
        for bad in [
            "",
            "Sat, 28 Nov 2026 20:00:00",
            "Sat, 28 Foo 2026 20:00:00 GMT",
            "Saturday, 28-Nov-26 20:00:00 GMT",
            "Sat Nov 28 20:00:00 2026",
        ] {
            assert_eq!(http_date_secs(bad), 0, "{bad:?}");
        }
    }
}
