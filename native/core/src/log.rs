//! The native engine's log lines: to stderr, which the mount process sends where its Python log goes,
//! in the same shape as pffs's own lines (pffs/cli/logs.py) and at most one a second per kind of line,
//! so a store that fails every read does not flood the log.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::sync::lock;

const SAME_LINE_EVERY: Duration = Duration::from_secs(1);

static LAST: Mutex<Option<HashMap<String, Instant>>> = Mutex::new(None);

/// A WARNING line; `what` should say what failed and what it means for the reader.
pub fn warn(what: &str) {
    line("WARNING", what);
}

pub fn info(what: &str) {
    line("INFO", what);
}

fn line(level: &str, what: &str) {
    // Lines of one kind (their text up to the first quote: the same failure of other keys) are
    // said once a second at most.
    let kind = what.split('"').next().unwrap_or(what).to_string();
    {
        let mut last = lock(&LAST);
        let seen = last.get_or_insert_with(HashMap::new);
        if seen
            .get(&kind)
            .is_some_and(|at| at.elapsed() < SAME_LINE_EVERY)
        {
            return;
        }
        seen.insert(kind, Instant::now());
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let text = format!(
        "{} pffs[{}] {level} pffs.native: {what}\n",
        timestamp(now),
        std::process::id()
    );
    let _ = std::io::stderr().write_all(text.as_bytes());
}

/// "2026-11-28 20:03:26,123" in UTC, as Python's logging writes asctime (its local time is UTC on
/// every machine pffs runs on: containers and CI).
fn timestamp(since_epoch: Duration) -> String {
    let secs = since_epoch.as_secs();
    let (days, rest) = (secs / 86400, secs % 86400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02},{:03}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since_epoch.subsec_millis()
    )
}

/// Howard Hinnant's algorithm: days since 1970-01-01 to (year, month, day).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_read_as_pythons() {
        assert_eq!(
            timestamp(Duration::from_millis(1_795_896_206_123)),
            "2026-11-28 20:03:26,123"
        );
        assert_eq!(timestamp(Duration::ZERO), "1970-01-01 00:00:00,000");
    }
}
