//! Who may call the server, checked before a route runs: the Host header
//! (a page a browser loaded from elsewhere can reach a server on localhost
//! through DNS rebinding, with its own name in Host), the content type of
//! a POST (browsers send form and text bodies across origins without
//! asking; JSON needs their preflight, which this server never grants),
//! and API keys (`Authorization: Bearer KEY`, as OpenAI's clients send,
//! compared in constant time). `/health` needs no key. Plain Rust: the
//! HTTP layer asks [`Access::check`] and answers its error.

use super::api::ApiError;
use subtle::ConstantTimeEq;

/// The Host headers a server accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowedHosts {
    /// Any (a server bound to a public address, by default).
    Any,
    /// These names, whatever the port (lowercase; IPv6 in brackets).
    Only(Vec<String>),
}

impl AllowedHosts {
    /// The default for a server bound to `bind`: on a loopback address the
    /// loopback names only (DNS rebinding targets servers there); else any.
    pub fn default_for(bind: &str) -> AllowedHosts {
        let loopback = ["127.0.0.1", "localhost", "::1", "[::1]"];
        if loopback.contains(&bind) || bind.starts_with("127.") {
            AllowedHosts::Only(
                ["localhost", "127.0.0.1", "[::1]", bind]
                    .iter()
                    .map(|h| bracket(h).to_ascii_lowercase())
                    .collect(),
            )
        } else {
            AllowedHosts::Any
        }
    }
    /// `--allowed-hosts`: `*` for any, else comma-separated names.
    pub fn parse(list: &str) -> Result<AllowedHosts, String> {
        if list.trim() == "*" {
            return Ok(AllowedHosts::Any);
        }
        let names: Vec<String> = list
            .split(',')
            .map(|h| bracket(h.trim()).to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        if names.is_empty() {
            return Err(format!("--allowed-hosts {list:?} names no host"));
        }
        Ok(AllowedHosts::Only(names))
    }
}

/// An IPv6 address as Host writes it, in brackets.
fn bracket(h: &str) -> String {
    if h.contains(':') && !h.starts_with('[') {
        format!("[{h}]")
    } else {
        h.to_string()
    }
}

/// The name of a Host header without its port.
fn host_name(host: &str) -> String {
    let h = host.trim();
    let name = if let Some(end) = h.strip_prefix('[').and_then(|r| r.find(']')) {
        &h[..end + 2]
    } else {
        h.rsplit_once(':').map_or(h, |(n, _)| n)
    };
    name.to_ascii_lowercase()
}

/// The server's access rules.
#[derive(Clone, Debug)]
pub struct Access {
    /// Keys a request may present; empty: none needed.
    pub keys: Vec<String>,
    pub hosts: AllowedHosts,
}

/// What [`Access::check`] looks at of a request.
pub struct RequestHead<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub host: Option<&'a str>,
    pub content_type: Option<&'a str>,
    pub authorization: Option<&'a str>,
}

impl Access {
    /// Whether the request may go on; the error to answer if not.
    pub fn check(&self, r: &RequestHead) -> Result<(), ApiError> {
        if let AllowedHosts::Only(names) = &self.hosts {
            let name = r.host.map(host_name).unwrap_or_default();
            if !names.contains(&name) {
                return Err(ApiError {
                    status: 403,
                    message: format!(
                        "Host {:?} is not served here (allowed: {}; see --allowed-hosts)",
                        r.host.unwrap_or(""),
                        names.join(", ")
                    ),
                });
            }
        }
        if r.method == "POST" {
            let json = r.content_type.is_some_and(|c| {
                c.split(';')
                    .next()
                    .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
            });
            if !json {
                return Err(ApiError {
                    status: 415,
                    message: format!(
                        "Content-Type {:?}: requests are JSON (send Content-Type: application/json)",
                        r.content_type.unwrap_or("")
                    ),
                });
            }
        }
        if self.keys.is_empty() || r.path == "/health" {
            return Ok(());
        }
        let given = r
            .authorization
            .and_then(|a| a.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| {
            // every key compared, each in constant time
            self.keys.iter().fold(false, |ok, k| {
                ok | bool::from(k.as_bytes().ct_eq(g.as_bytes()))
            })
        });
        if ok {
            Ok(())
        } else {
            Err(ApiError {
                status: 401,
                message: if given.is_some() {
                    "invalid API key".into()
                } else {
                    "an API key is needed: Authorization: Bearer KEY".into()
                },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head<'a>(
        method: &'a str,
        path: &'a str,
        host: Option<&'a str>,
        ct: Option<&'a str>,
        auth: Option<&'a str>,
    ) -> RequestHead<'a> {
        RequestHead {
            method,
            path,
            host,
            content_type: ct,
            authorization: auth,
        }
    }

    #[test]
    fn hosts_keys_and_content_types() {
        let a = Access {
            keys: vec!["k1".into(), "secret-2".into()],
            hosts: AllowedHosts::default_for("127.0.0.1"),
        };
        let json = Some("application/json; charset=utf-8");
        let post = |host, ct, auth| a.check(&head("POST", "/v1/completions", host, ct, auth));
        assert!(post(Some("localhost:8080"), json, Some("Bearer secret-2")).is_ok());
        assert!(post(Some("127.0.0.1:9"), json, Some("Bearer k1")).is_ok());
        assert!(post(Some("[::1]:8080"), json, Some("Bearer k1")).is_ok());
        // DNS rebinding: another name for the same address
        assert_eq!(
            post(Some("evil.example:8080"), json, Some("Bearer k1"))
                .unwrap_err()
                .status,
            403
        );
        assert_eq!(post(None, json, Some("Bearer k1")).unwrap_err().status, 403);
        // forms and text, which browsers send across origins
        for ct in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
        ] {
            assert_eq!(
                post(Some("localhost"), ct, Some("Bearer k1"))
                    .unwrap_err()
                    .status,
                415
            );
        }
        // keys
        assert_eq!(post(Some("localhost"), json, None).unwrap_err().status, 401);
        assert_eq!(
            post(Some("localhost"), json, Some("Bearer k2"))
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(
            post(Some("localhost"), json, Some("k1"))
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(
            post(Some("localhost"), json, Some("Bearer k"))
                .unwrap_err()
                .status,
            401
        );
        // /health is open, /v1/models is not
        assert!(a
            .check(&head("GET", "/health", Some("localhost"), None, None))
            .is_ok());
        assert_eq!(
            a.check(&head("GET", "/v1/models", Some("localhost"), None, None))
                .unwrap_err()
                .status,
            401
        );
    }

    #[test]
    fn allowed_hosts_parse_and_defaults() {
        assert_eq!(AllowedHosts::default_for("0.0.0.0"), AllowedHosts::Any);
        assert_eq!(AllowedHosts::parse("*").unwrap(), AllowedHosts::Any);
        assert_eq!(
            AllowedHosts::parse("Box.lan, ::1").unwrap(),
            AllowedHosts::Only(vec!["box.lan".into(), "[::1]".into()])
        );
        assert!(AllowedHosts::parse(" , ").is_err());
        let open = Access {
            keys: Vec::new(),
            hosts: AllowedHosts::parse("box.lan").unwrap(),
        };
        let r = |h| open.check(&head("GET", "/v1/models", Some(h), None, None));
        assert!(r("BOX.lan:80").is_ok());
        assert_eq!(r("localhost").unwrap_err().status, 403);
    }
}
