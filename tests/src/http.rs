//! Calls to a daemon's HTTP API, and the replies as JSON.

use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::{Daemon, TOKEN};

/// A response: status and JSON body (`Null` when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    /// Reads status, headers and a JSON body (`Null` when the body is not JSON).
    async fn read(resp: reqwest::Response) -> anyhow::Result<Self> {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Self {
            status,
            headers,
            body,
        })
    }
}

impl Daemon {
    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.api_port)
    }

    /// Sends a request; `body` is sent as-is with `Content-Type: application/json`.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> anyhow::Result<Reply> {
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let mut req = self.http.request(method, format!("{}{path}", self.base()));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        Reply::read(resp).await
    }

    /// POSTs `body` to `path` on a fresh connection that is not reused afterwards: for requests
    /// the daemon may answer by closing the connection (oversized bodies).
    pub async fn post_once(&self, path: &str, body: String) -> anyhow::Result<Reply> {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(10))
            .build()?;
        let resp = client
            .post(format!("{}{path}", self.base()))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        Reply::read(resp).await
    }

    /// GETs `path` and returns the status and the body as text (for /metrics).
    pub async fn get_text(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let resp = self
            .http
            .get(format!("{}{path}", self.base()))
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        let status = resp.status().as_u16();
        Ok((status, resp.text().await?))
    }

    /// GET with the admin token (tenant data and cluster state need a `read` or `admin` one).
    pub async fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.request("GET", path, Some(TOKEN), None).await
    }

    /// Creates or replaces a policy with the admin token; fails unless 200.
    pub async fn put_policy(
        &self,
        tenant: &str,
        policy: &str,
        spec: Value,
    ) -> anyhow::Result<Value> {
        let r = self
            .request(
                "PUT",
                &format!("/v1/tenants/{tenant}/policies/{policy}"),
                Some(TOKEN),
                Some(spec.to_string()),
            )
            .await?;
        if r.status != 200 {
            bail!("PUT policy answered {}: {}", r.status, r.body);
        }
        Ok(r.body)
    }

    /// One check.
    pub async fn check(&self, tenant: &str, policy: &str, cost: u64) -> anyhow::Result<Reply> {
        let body = serde_json::json!({"tenant": tenant, "policy": policy, "cost": cost});
        self.request("POST", "/v1/check", None, Some(body.to_string()))
            .await
    }
}
