//! What a command line must not carry. Every local user can read every process's arguments
//! (`ps`, `/proc/<pid>/cmdline`), so a flag whose value is a URL with a password is refused
//! before anything runs, with the environment variable to use instead.

use std::ffi::OsString;

#[derive(Debug, thiserror::Error)]
#[error(
    "{flag} carries a password on the command line, where every local user can read it (ps, /proc/<pid>/cmdline): set {env} instead"
)]
pub struct PasswordInArguments {
    pub flag: &'static str,
    pub env: &'static str,
}

/// Refuses `flag VALUE` or `flag=VALUE` among `args` (a process's arguments) when the value is
/// a URL with a password (`scheme://user:secret@…` or a `password=` query parameter).
pub fn refuse_password(
    args: impl IntoIterator<Item = OsString>,
    flag: &'static str,
    env: &'static str,
) -> Result<(), PasswordInArguments> {
    let mut args = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    let assigned = format!("{flag}=");
    while let Some(arg) = args.next() {
        let value = if arg == flag {
            args.next()
        } else {
            arg.strip_prefix(&assigned).map(str::to_owned)
        };
        if value.as_deref().is_some_and(has_password) {
            return Err(PasswordInArguments { flag, env });
        }
    }
    Ok(())
}

/// Whether a URL carries a password: in its user info or as a query parameter.
pub fn has_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = before_query.split(['/', '#']).next().unwrap_or("");
    let in_user_info = authority
        .rsplit_once('@')
        .and_then(|(user_info, _)| user_info.split_once(':'))
        .is_some_and(|(_, password)| !password.is_empty());
    let in_query = query.split(['&', '#']).any(|pair| {
        pair.split_once('=')
            .is_some_and(|(key, value)| key.to_ascii_lowercase().contains("password") && !value.is_empty())
    });
    in_user_info || in_query
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_password_in_a_url_is_found_wherever_it_is() {
        for url in [
            "postgres://app:s3cret@db:5432/pool",
            "postgres://app:s3cret@db/pool?sslmode=require",
            "postgresql://db/pool?user=app&password=s3cret",
            "postgres://db/pool?sslmode=verify-full&sslpassword=k",
        ] {
            assert!(has_password(url), "{url}");
        }
        for url in [
            "postgres://app@db/pool",
            "postgres://app:@db/pool",
            "postgres://db/pool?sslmode=require",
            "sqlite:///var/lib/pool.db?mode=rwc",
            "sqlite:pool.db",
            "not a url",
        ] {
            assert!(!has_password(url), "{url}");
        }
    }

    #[test]
    fn the_flag_is_refused_in_both_spellings_and_only_with_a_password() {
        let with = "postgres://app:s3cret@db/pool";
        for argv in [
            args(&["local-pool", "--database-url", with]),
            args(&["local-pool", "--sandboxes", "3", &format!("--database-url={with}")]),
        ] {
            let err = refuse_password(argv, "--database-url", "OPENSHELL_LOCAL_DATABASE_URL").unwrap_err();
            let message = err.to_string();
            assert!(message.contains("OPENSHELL_LOCAL_DATABASE_URL"), "{message}");
            assert!(
                !message.contains("s3cret"),
                "the refusal does not repeat the secret: {message}"
            );
        }
        for argv in [
            args(&["local-pool", "--database-url", "postgres://app@db/pool"]),
            args(&["local-pool", "--other", with]),
            args(&["local-pool", "--database-url"]),
        ] {
            assert!(refuse_password(argv, "--database-url", "X").is_ok());
        }
    }
}
