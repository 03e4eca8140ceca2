//! A fresh database per scenario on a PostgreSQL server given by URL.

use super::{Error, now_ms};

/// A fresh database on the PostgreSQL server of `admin_url`.
pub(crate) async fn fresh_database(admin_url: &str, scenario: &str) -> Result<String, Error> {
    use sqlx::{Connection as _, Executor as _};
    sqlx::any::install_default_drivers();
    let name = format!("scenario_{}_{}", scenario.replace('-', "_"), now_ms());
    let mut admin = sqlx::AnyConnection::connect(admin_url).await.map_err(|e| {
        Error::Scenario(format!(
            "cannot connect to {}: {}",
            gateway::store::redact_url(admin_url),
            gateway::store::scrub(&e.to_string(), admin_url)
        ))
    })?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .map_err(|e| Error::Scenario(format!("cannot create database {name}: {e}")))?;
    let _ = admin.close().await;
    let mut url = url_with_database(admin_url, &name);
    if url.is_empty() {
        url = admin_url.to_owned();
    }
    Ok(url)
}

fn url_with_database(url: &str, database: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, query) = match rest.split_once('?') {
                Some((a, q)) => (a, Some(q)),
                None => (rest, None),
            };
            let host = authority.split('/').next().unwrap_or(authority);
            let mut out = format!("{scheme}://{host}/{database}");
            if let Some(q) = query {
                out.push('?');
                out.push_str(q);
            }
            out
        }
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_keep_host_and_query() {
        assert_eq!(
            url_with_database("postgres://u@127.0.0.1:5432/postgres?sslmode=disable", "x"),
            "postgres://u@127.0.0.1:5432/x?sslmode=disable"
        );
        assert_eq!(url_with_database("postgres://h", "x"), "postgres://h/x");
    }
}
