//! One gateway replica's command line and environment (the database URL and other secrets go
//! through the environment, never the command line).

use super::*;

/// How a gateway replica of the local pool is started.
pub struct GatewayLaunch<'a> {
    pub name: &'a str,
    pub listen: &'a str,
    pub health_listen: Option<&'a str>,
    pub database_url: &'a str,
    pub credentials: &'a Path,
    pub kek: &'a Path,
    pub lease_length_ms: u64,
    pub tls: Option<&'a TlsFiles>,
    /// Members that get a token of their own.
    pub members: &'a [String],
    /// Instance routes whose sidecars get a bootstrap token.
    pub instances: &'a [String],
}

impl GatewayLaunch<'_> {
    /// The command line and the environment. Secrets never go on the command line (any
    /// local user can read it): `DATABASE_URL`, which may carry a password, goes in the
    /// environment; the KEK and the TLS key are passed as paths to 0600 files.
    pub fn command(&self) -> (Vec<String>, Vec<(String, String)>) {
        let mut args: Vec<String> = vec![
            "--replica".into(),
            self.name.into(),
            "--listen".into(),
            self.listen.into(),
            "--credentials-dir".into(),
            self.credentials.display().to_string(),
            "--key-encryption-key-file".into(),
            self.kek.display().to_string(),
            "--status-interval-ms".into(),
            "0".into(),
            "--lease-length-ms".into(),
            self.lease_length_ms.to_string(),
        ];
        if let Some(health) = self.health_listen {
            args.extend(["--health-listen".to_owned(), health.to_owned()]);
        }
        for (flag, list) in [("--members", self.members), ("--instances", self.instances)] {
            if !list.is_empty() {
                args.extend([flag.to_owned(), list.join(",")]);
            }
        }
        if let Some(tls) = self.tls {
            // --tls-ca: the coordinator delivers ca.crt beside every token.
            for (flag, path) in [
                ("--tls-cert", &tls.cert),
                ("--tls-key", &tls.key),
                ("--tls-ca", &tls.ca),
            ] {
                args.extend([flag.to_owned(), path.display().to_string()]);
            }
        }
        let env = vec![("DATABASE_URL".to_owned(), self.database_url.to_owned())];
        (args, env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_secret_goes_on_a_gateway_command_line() {
        let dir = Path::new("/pool");
        let tls = TlsFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        for url in [
            "postgres://app:hunter2@127.0.0.1:5432/pool",
            "postgres://127.0.0.1/pool?user=app&password=hunter2",
            "host=127.0.0.1 user=app password=hunter2 dbname=pool",
        ] {
            let launch = GatewayLaunch {
                name: "gateway-0",
                listen: "127.0.0.1:1",
                health_listen: None,
                database_url: url,
                credentials: &dir.join("credentials"),
                kek: &dir.join("key-encryption-key"),
                lease_length_ms: 1000,
                tls: Some(&tls),
                members: &["supervisor-0".to_owned()],
                instances: &["default/sandbox-0".to_owned()],
            };
            let (args, env) = launch.command();
            assert!(args.iter().all(|a| !a.contains("hunter2")), "{args:?}");
            assert!(!args.iter().any(|a| a.contains("database")), "{args:?}");
            assert_eq!(env, vec![("DATABASE_URL".to_owned(), url.to_owned())]);
            let kek = args.iter().position(|a| a == "--key-encryption-key-file").unwrap();
            assert_eq!(args[kek + 1], "/pool/key-encryption-key", "the KEK is passed as a path");
        }
    }
}
