//! Time formatting for tool output, without a date library: ctime-style dates in UTC
//! ("Sun Nov 22 02:58:25 2026", as dumpe2fs prints with TZ=UTC) and ISO-like
//! "2026-11-22 02:58:25.123456789 +0000" (as stat(1) prints).

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn split(sec: i64) -> (i64, u32, u32, u32, u32, u32, usize) {
    let days = sec.div_euclid(86_400);
    let rem = sec.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    let wday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    (
        y,
        mo,
        d,
        (rem / 3600) as u32,
        (rem / 60 % 60) as u32,
        (rem % 60) as u32,
        wday,
    )
}

pub fn ctime(sec: i64) -> String {
    const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, mo, d, h, mi, s, wd) = split(sec);
    format!(
        "{} {} {:2} {h:02}:{mi:02}:{s:02} {y}",
        DAYS[wd],
        MONTHS[mo as usize - 1],
        d
    )
}

pub fn iso(sec: i64, nsec: u32) -> String {
    let (y, mo, d, h, mi, s, _) = split(sec);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{nsec:09} +0000")
}

/// "Nov 22 02:58" / "Nov 22  2020" as ls -l prints (recent = within ~6 months of now).
pub fn ls_time(sec: i64, now: i64) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, mo, d, h, mi, _, _) = split(sec);
    let recent = (now - sec).abs() < 183 * 86_400;
    if recent {
        format!("{} {:2} {h:02}:{mi:02}", MONTHS[mo as usize - 1], d)
    } else {
        format!("{} {:2} {y:5}", MONTHS[mo as usize - 1], d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(ctime(0), "Thu Jan  1 00:00:00 1970");
        assert_eq!(ctime(1_795_316_305), "Sun Nov 22 02:58:25 2026");
        assert_eq!(iso(-1, 5), "1969-12-31 23:59:59.000000005 +0000");
        assert_eq!(iso(7_258_118_400, 0), "2200-01-01 00:00:00.000000000 +0000");
    }
}
