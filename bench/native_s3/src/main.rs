//! `s3get --client hand|object_store`: GETs a list of objects (or byte ranges of them) from one S3 endpoint
//! with one of the candidate clients for pffs's native core (issue 44), and prints one line of JSON: objects,
//! bytes, wall seconds and user + system CPU seconds (getrusage of this process, every thread) of the GETs
//! alone, and the sha256 of every body, computed after the clock stops.
//!
//! The request comes on stdin (so no secret is in argv), one `name value` per line:
//!
//! ```text
//! endpoint http://127.0.0.1:8333
//! bucket bench-data
//! access_key ...
//! secret_key ...
//! region us-east-1
//! threads 8
//! job small/00000.bin 0 131072        (key, first byte, length; any number of these)
//! ```
//!
//! Every body is received into its own buffer, allocated and touched before the clock starts (a cache
//! receives into a block it already holds), so page faults are not counted against any client.

use std::io::{self, BufRead, Write};
use std::time::Instant;

#[cfg(feature = "hand")]
mod hand;
#[cfg(feature = "object_store")]
mod objstore;

/// One GET: the body of `key`, bytes [start, start + buffer.len()).
pub struct Job {
    pub index: usize,
    pub key: String,
    pub start: u64,
    pub buffer: Vec<u8>,
}

pub struct Spec {
    pub endpoint: String,
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
    pub region: String,
    pub threads: usize,
}

fn read_request() -> Result<(Spec, Vec<Job>), String> {
    let mut spec = Spec {
        endpoint: String::new(),
        bucket: String::new(),
        access_key: String::new(),
        secret_key: String::new(),
        region: "us-east-1".into(),
        threads: 8,
    };
    let mut jobs = Vec::new();
    for line in io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut words = line.split_whitespace();
        let (Some(name), rest) = (words.next(), words.collect::<Vec<_>>()) else {
            continue;
        };
        let value = || {
            rest.first()
                .map(|v| v.to_string())
                .ok_or(format!("{name}: no value"))
        };
        match name {
            "endpoint" => spec.endpoint = value()?,
            "bucket" => spec.bucket = value()?,
            "access_key" => spec.access_key = value()?,
            "secret_key" => spec.secret_key = value()?,
            "region" => spec.region = value()?,
            "threads" => spec.threads = value()?.parse().map_err(|_| "threads: not a number")?,
            "job" => {
                let [key, start, length] = rest[..] else {
                    return Err(format!("job wants key, start and length: {line:?}"));
                };
                let start = start
                    .parse()
                    .map_err(|_| format!("bad start in {line:?}"))?;
                let length: usize = length
                    .parse()
                    .map_err(|_| format!("bad length in {line:?}"))?;
                // Touched now, so the clock counts no page faults (as a cache's blocks already are).
                let buffer = vec![1u8; length];
                jobs.push(Job {
                    index: jobs.len(),
                    key: key.to_string(),
                    start,
                    buffer,
                });
            }
            _ => return Err(format!("unknown line {line:?}")),
        }
    }
    if spec.endpoint.is_empty() || spec.bucket.is_empty() || spec.threads == 0 {
        return Err("endpoint, bucket and threads > 0 are needed".into());
    }
    Ok((spec, jobs))
}

/// User and system CPU seconds of this process so far (every thread).
fn cpu_seconds() -> (f64, f64) {
    // SAFETY: getrusage writes one rusage into the zeroed struct we own; it has no other effect.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (seconds(usage.ru_utime), seconds(usage.ru_stime))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The GETs, ready to run: the jobs back with their buffers filled.
pub type Run = Box<dyn FnOnce() -> Result<Vec<Job>, String>>;
/// Makes a client (runtime, signer: everything that is not a GET) and returns its run.
type Runner = fn(&Spec, Vec<Job>) -> Result<Run, String>;

fn runner(client: &str) -> Option<Runner> {
    match client {
        #[cfg(feature = "hand")]
        "hand" => Some(hand::prepare),
        #[cfg(feature = "object_store")]
        "object_store" => Some(objstore::prepare),
        _ => None,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let client = match &args[1..] {
        [flag, client] if flag == "--client" => client.clone(),
        _ => {
            let built = [
                cfg!(feature = "hand").then_some("hand"),
                cfg!(feature = "object_store").then_some("object_store"),
            ];
            let built: Vec<_> = built.into_iter().flatten().collect();
            eprintln!(
                "usage: s3get --client {} < request (see the source's head)",
                built.join("|")
            );
            std::process::exit(2);
        }
    };
    let Some(prepare) = runner(&client) else {
        eprintln!("s3get: client {client:?} is not built in (cargo build --features {client})");
        std::process::exit(2);
    };
    let result = read_request().and_then(|(spec, jobs)| {
        let count = jobs.len();
        let run = prepare(&spec, jobs)?; // client made (runtime, signer), outside the clock
        let (user0, sys0) = cpu_seconds();
        let started = Instant::now();
        let mut jobs = run()?;
        let wall = started.elapsed().as_secs_f64();
        let (user1, sys1) = cpu_seconds();
        if jobs.len() != count {
            return Err(format!("{} of {count} GETs came back", jobs.len()));
        }
        jobs.sort_by_key(|j| j.index);
        let bytes: usize = jobs.iter().map(|j| j.buffer.len()).sum();
        let digests: Vec<String> = jobs
            .iter()
            .map(|j| {
                use sha2::Digest;
                format!("\"{}\"", hex(&sha2::Sha256::digest(&j.buffer)))
            })
            .collect();
        Ok(format!(
            "{{\"client\": \"{client}\", \"threads\": {}, \"objects\": {count}, \"bytes\": {bytes}, \
             \"wall_seconds\": {wall:.6}, \"user_seconds\": {:.6}, \"system_seconds\": {:.6}, \"sha256\": [{}]}}",
            spec.threads,
            user1 - user0,
            sys1 - sys0,
            digests.join(", ")
        ))
    });
    match result {
        Ok(line) => {
            let mut out = io::stdout().lock();
            writeln!(out, "{line}").expect("stdout");
        }
        Err(message) => {
            eprintln!("s3get ({client}): {message}");
            std::process::exit(1);
        }
    }
}
