//! Database connection strings without their secrets, for every message and log line:
//! [`redact_url`] for the string itself (any form `DATABASE_URL` may take), [`scrub`] for
//! text derived from it (a driver's error message).

/// What replaces a password.
const HIDDEN: &str = "***";

/// `url` with its password hidden, in every form a connection string takes:
/// - a URL with a scheme (`postgres://user:pw@host/db`): password replaced, query dropped
///   (it may carry `password=`, `sslpassword=` or key paths);
/// - without a scheme (`user:pw@host/db`, also percent-encoded): everything between the
///   first `:` and the last `@` replaced, query dropped;
/// - libpq key/value (`host=db user=u password='p w'`): the value of every key naming a
///   password replaced.
///
/// When the string fits none of these it is not shown at all.
pub fn redact_url(url: &str) -> String {
    let url = url.trim();
    if url.contains("://") {
        return match url::Url::parse(url) {
            Ok(mut parsed) => {
                if parsed.password().is_some() {
                    let _ = parsed.set_password(Some(HIDDEN));
                }
                parsed.set_query(None);
                parsed.to_string()
            }
            Err(_) => without_scheme(url.split_once("://").map_or(url, |(_, rest)| rest)).map_or_else(
                || "<unparseable URL>".into(),
                |rest| format!("<unparseable URL> {rest}"),
            ),
        };
    }
    if is_key_value(url) {
        return key_value(url).unwrap_or_else(|| "<unparseable connection string>".into());
    }
    if let Some(path) = url.strip_prefix("sqlite:") {
        return format!("sqlite:{}", strip_query(path));
    }
    without_scheme(url).unwrap_or_else(|| "<unparseable URL>".into())
}

/// `text` (for example a driver's error about `url`) with the password of `url` removed,
/// raw and percent-decoded.
pub fn scrub(text: &str, url: &str) -> String {
    let mut text = text.to_owned();
    for secret in secrets(url) {
        if !secret.is_empty() {
            text = text.replace(&secret, HIDDEN);
        }
    }
    text
}

/// The password forms `url` may carry, longest first.
fn secrets(url: &str) -> Vec<String> {
    let url = url.trim();
    let mut found = Vec::new();
    if is_key_value(url) {
        found.extend(
            pairs(url)
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| is_secret_key(k))
                .map(|(_, v)| v),
        );
    } else {
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
        if let Some((credentials, _)) = before_query.rsplit_once('@')
            && let Some((_, password)) = credentials.split_once(':')
        {
            found.push(password.to_owned());
        }
        for pair in query.split('&') {
            if let Some((key, value)) = pair.split_once('=')
                && is_secret_key(key)
            {
                found.push(value.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found
        .iter()
        .filter_map(|s| percent_decode(s))
        .filter(|d| !found.contains(d))
        .collect();
    found.extend(decoded);
    found.sort_by_key(|s| std::cmp::Reverse(s.len()));
    found
}

/// `user:pw@host/db?…` → `user:***@host/db`; `None` when there is nothing to show safely.
fn without_scheme(rest: &str) -> Option<String> {
    let rest = strip_query(rest);
    match rest.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split_once(':').map_or(credentials, |(user, _)| user);
            if credentials.contains(':') {
                Some(format!("{user}:{HIDDEN}@{host}"))
            } else {
                Some(format!("{user}@{host}"))
            }
        }
        // No credentials part: a bare `host:port/db` (a colon here is a port, not a password).
        None => Some(rest.to_owned()),
    }
}

fn strip_query(s: &str) -> &str {
    s.split_once('?').map_or(s, |(before, _)| before)
}

/// libpq's `keyword = value` form: starts with a keyword and `=`, before any `/` or `@`.
fn is_key_value(s: &str) -> bool {
    let Some((key, _)) = s.split_once('=') else {
        return false;
    };
    let key = key.trim();
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_secret_key(key: &str) -> bool {
    key.to_ascii_lowercase().contains("password")
}

fn key_value(s: &str) -> Option<String> {
    let shown: Vec<String> = pairs(s)?
        .into_iter()
        .map(|(key, value)| {
            if is_secret_key(&key) {
                format!("{key}={HIDDEN}")
            } else if value.is_empty() || value.contains(char::is_whitespace) {
                format!("{key}='{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
            } else {
                format!("{key}={value}")
            }
        })
        .collect();
    Some(shown.join(" "))
}

/// The `(keyword, value)` pairs of a libpq connection string (values unquoted); `None` when
/// it does not parse.
fn pairs(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Some(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') || key.is_empty() {
            return None;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next()? {
                    '\\' => value.push(chars.next()?),
                    '\'' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next()?);
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

fn percent_decode(s: &str) -> Option<String> {
    if !s.contains('%') {
        return None;
    }
    let decoded: Vec<u8> = url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned().into_bytes())?;
    String::from_utf8(decoded).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form `DATABASE_URL` takes, with the secret it carries.
    const FORMS: [(&str, &str); 9] = [
        ("postgres://user:hunter2@db:5432/app?sslmode=require", "hunter2"),
        ("postgresql://user:hunter2@db/app", "hunter2"),
        ("user:hunter2@db/app", "hunter2"),
        ("user:hunter2@db:5432/app?sslmode=disable", "hunter2"),
        ("postgres://user:hunt%40er%2F2@db/app", "hunt@er/2"),
        ("user:hunt%40er2@db/app", "hunt@er2"),
        ("user:hunt@er2@db/app", "hunt@er2"),
        ("postgres://db/app?user=u&password=hunter2", "hunter2"),
        ("host=db user=u password='hunter 2' dbname=app", "hunter 2"),
    ];

    #[test]
    fn no_form_shows_its_password() {
        for (url, secret) in FORMS {
            let shown = redact_url(url);
            assert!(!shown.contains(secret), "{url} -> {shown}");
            assert!(!shown.contains("hunt"), "{url} -> {shown}");
            assert!(shown.contains("db"), "the host is still shown: {url} -> {shown}");
            let message = format!("connection to {url} failed: password {secret} refused");
            let scrubbed = scrub(&message, url);
            assert!(!scrubbed.contains("hunt"), "{url} -> {scrubbed}");
        }
    }

    #[test]
    fn the_shown_forms_keep_what_helps() {
        assert_eq!(
            redact_url("postgres://user:hunter2@db:5432/app?sslpassword=x"),
            "postgres://user:***@db:5432/app"
        );
        assert_eq!(redact_url("user:hunter2@db/app"), "user:***@db/app");
        assert_eq!(redact_url("user@db/app?password=x"), "user@db/app");
        assert_eq!(
            redact_url("host=db user=u password='hunter 2' sslpassword=x dbname=app"),
            "host=db user=u password=*** sslpassword=*** dbname=app"
        );
        assert_eq!(redact_url("password=hunter2"), "password=***");
        assert_eq!(
            redact_url("sqlite:///var/lib/gw/gateway.db?mode=rwc"),
            "sqlite:///var/lib/gw/gateway.db"
        );
        assert_eq!(redact_url("sqlite:gateway.db?mode=rwc"), "sqlite:gateway.db");
        assert_eq!(redact_url("db:5432/app"), "db:5432/app");
        // Unterminated quote: nothing of it is shown.
        assert_eq!(
            redact_url("host=db password='hunter2"),
            "<unparseable connection string>"
        );
        let broken = redact_url("postgres://user:hunter2@[db/app");
        assert!(!broken.contains("hunter2"), "{broken}");
    }
}
