//! RFC 9457 problem responses: the one `ApiError` every handler returns, and the JSON extractor
//! that turns body rejections into problems naming what was wrong.
//!
//! Client errors explain themselves; internal errors are logged and answered without detail.

use axum::body::Bytes;
use axum::extract::path::ErrorKind;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, RawPathParams, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use quota_core::policy::FieldError;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The media type of problem bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";
/// Problem type of a denied check (IETF ratelimit-headers draft).
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";
/// Problem type when capacity is temporarily reduced (IETF ratelimit-headers draft).
pub const REDUCED_CAPACITY_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// One field problem in a problem body.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct FieldProblem {
    pub field: String,
    pub message: String,
}

impl From<&FieldError> for FieldProblem {
    fn from(e: &FieldError) -> Self {
        Self {
            field: e.field.to_string(),
            message: e.message.clone(),
        }
    }
}

/// An RFC 9457 problem body with quotad's machine-readable `code`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    pub code: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldProblem>,
    #[serde(rename = "violated-policies", skip_serializing_if = "Vec::is_empty")]
    pub violated_policies: Vec<String>,
}

/// Every way an API call fails.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{field}: {message}")]
    BadField { field: String, message: String },
    /// A body, query or path that could not be read; `errors` names each part at fault.
    #[error("{detail}")]
    BadRequest {
        detail: String,
        errors: Vec<FieldProblem>,
    },
    #[error("invalid policy")]
    InvalidPolicy { errors: Vec<FieldProblem> },
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A known token without the scope the route needs.
    #[error("the token `{token}` has scope `{has}`; this route needs `{needs}` (or `admin`)")]
    Forbidden {
        token: String,
        has: &'static str,
        needs: &'static str,
    },
    #[error("{what} not found")]
    NotFound { what: &'static str },
    /// A named field refers to something that does not exist (e.g. an unknown `plan`).
    #[error("{field}: {message}")]
    UnknownField { field: String, message: String },
    /// A named field needs configuration this daemon lacks (e.g. `identity` without an
    /// identity key).
    #[error("{field}: {message}")]
    NotConfigured { field: String, message: String },
    /// The path exists, the method does not (the router adds the `Allow` header).
    #[error("this path does not serve this method; the Allow header lists those it does")]
    MethodNotAllowed,
    #[error("request body larger than the limit")]
    TooLarge,
    #[error("expected Content-Type: application/json")]
    UnsupportedMediaType,
    #[error("temporarily reduced capacity: {reason}")]
    ReducedCapacity { policy: String, reason: String },
    /// Reduced capacity that is no one policy's (a hold's store or region did not answer).
    #[error("temporarily reduced capacity: {reason}")]
    Unavailable { reason: String },
    #[error("coordinator unavailable: {reason}")]
    CoordinatorUnavailable { reason: String },
    /// The request outran the configured request timeout (`[api] request_timeout_ms`).
    #[error("the request did not complete within {after_ms} ms")]
    Timeout { after_ms: u64 },
    #[error("{detail}")]
    Conflict { detail: String },
    #[error("internal error")]
    Internal {
        context: &'static str,
        source: anyhow::Error,
    },
}

impl ApiError {
    /// A problem with one named field.
    pub fn field(field: impl Into<String>, message: &impl ToString) -> Self {
        Self::BadField {
            field: field.into(),
            message: message.to_string(),
        }
    }

    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::BadField { .. } | ApiError::BadRequest { .. } => {
                (StatusCode::BAD_REQUEST, "INVALID_REQUEST")
            }
            ApiError::InvalidPolicy { .. } => (StatusCode::BAD_REQUEST, "INVALID_POLICY"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
            ApiError::Forbidden { .. } => (StatusCode::FORBIDDEN, "FORBIDDEN"),
            ApiError::NotFound { .. } | ApiError::UnknownField { .. } => {
                (StatusCode::NOT_FOUND, "NOT_FOUND")
            }
            ApiError::NotConfigured { .. } => (StatusCode::BAD_REQUEST, "NOT_CONFIGURED"),
            ApiError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "METHOD_NOT_ALLOWED"),
            ApiError::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE"),
            ApiError::UnsupportedMediaType => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "UNSUPPORTED_MEDIA_TYPE")
            }
            ApiError::ReducedCapacity { .. } | ApiError::Unavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "TEMPORARY_REDUCED_CAPACITY",
            ),
            ApiError::CoordinatorUnavailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "COORDINATOR_UNAVAILABLE")
            }
            ApiError::Timeout { .. } => (StatusCode::SERVICE_UNAVAILABLE, "REQUEST_TIMEOUT"),
            ApiError::Conflict { .. } => (StatusCode::CONFLICT, "CONFLICT"),
            ApiError::Internal { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL"),
        }
    }

    /// The problem body for this error.
    pub fn problem(&self) -> Problem {
        let (status, code) = self.status_and_code();
        let type_ = match self {
            ApiError::ReducedCapacity { .. } | ApiError::Unavailable { .. } => {
                REDUCED_CAPACITY_TYPE.to_string()
            }
            _ => format!(
                "urn:quotad:problem:{}",
                code.to_ascii_lowercase().replace('_', "-")
            ),
        };
        let detail = match self {
            ApiError::Internal { .. } => {
                "an internal error occurred; it has been logged".to_string()
            }
            other => other.to_string(),
        };
        let errors = match self {
            ApiError::InvalidPolicy { errors } | ApiError::BadRequest { errors, .. } => {
                errors.clone()
            }
            ApiError::BadField { field, message }
            | ApiError::UnknownField { field, message }
            | ApiError::NotConfigured { field, message } => {
                vec![FieldProblem {
                    field: field.clone(),
                    message: message.clone(),
                }]
            }
            _ => Vec::new(),
        };
        let violated_policies = match self {
            ApiError::ReducedCapacity { policy, .. } => vec![policy.clone()],
            _ => Vec::new(),
        };
        Problem {
            type_,
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            status: status.as_u16(),
            detail,
            code: code.to_string(),
            errors,
            violated_policies,
        }
    }
}

/// Serializes a problem body with its status and media type.
pub fn problem_response(status: StatusCode, body: &impl Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut resp = (status, bytes).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    resp
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal { context, source } = &self {
            tracing::error!(error = format!("{source:#}"), context, "Internal error.");
        }
        let problem = self.problem();
        let status =
            StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        metrics::counter!(crate::telemetry::REJECTED_REQUESTS_TOTAL, "code" => problem.code.clone())
            .increment(1);
        let mut resp = problem_response(status, &problem);
        if matches!(self, ApiError::Unauthorized) {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// A JSON body whose rejections become problem responses.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !json_content_type(req.headers()) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let body = Bytes::from_request(req, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::TooLarge
            } else {
                bad_request("body", "could not be read")
            }
        })?;
        json_object(&body).map(Self)
    }
}

/// A one-problem [`ApiError::BadRequest`].
pub(crate) fn bad_request(field: impl Into<String>, message: impl Into<String>) -> ApiError {
    let (field, message) = (field.into(), message.into());
    ApiError::BadRequest {
        detail: format!("{field}: {message}"),
        errors: vec![FieldProblem { field, message }],
    }
}

/// Parses a request body that must be a JSON object. serde also reads a struct from a JSON
/// array of its fields in order; the API takes objects only, so field names are never
/// guessed from positions.
pub(crate) fn json_object<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => return Err(bad_request("body", "must be a JSON object")),
        None => return Err(bad_request("body", "is empty; it must be a JSON object")),
    }
    // Most bodies are valid: parse them directly, and run the parse that tracks the path to
    // the bad field only to explain a failure.
    if let Ok(v) = serde_json::from_slice::<T>(body) {
        return Ok(v);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let err = match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(v) => match de.end() {
            Ok(()) => return Ok(v),
            Err(e) => return Err(bad_request("body", json_syntax(&e))),
        },
        Err(e) => e,
    };
    let path = err.path().to_string();
    let inner = err.into_inner();
    if inner.is_data() {
        let problem = data_problem(&path, &inner.to_string());
        Err(ApiError::BadRequest {
            detail: format!("{}: {}", problem.field, problem.message),
            errors: vec![problem],
        })
    } else {
        Err(bad_request("body", json_syntax(&inner)))
    }
}

/// A syntax error's message, in the API's words.
fn json_syntax(e: &serde_json::Error) -> String {
    format!(
        "is not valid JSON: {} (line {}, column {})",
        strip_position(&e.to_string()),
        e.line(),
        e.column()
    )
}

/// serde_json's message without its " at line L column C" tail.
fn strip_position(msg: &str) -> &str {
    msg.rfind(" at line ").map_or(msg, |i| &msg[..i])
}

/// One field's problem from serde's message about it at `path` (`.` for the body itself),
/// with the JSON types named as JSON does (never a Rust type such as `f64` or `struct X`).
pub(crate) fn data_problem(path: &str, message: &str) -> FieldProblem {
    let msg = strip_position(message);
    let quoted = |s: &str| s.split('`').nth(1).map(str::to_string);
    let field_in = |name: Option<String>| match (path, name) {
        (".", Some(name)) => name,
        (".", None) => "body".to_string(),
        (p, Some(name)) if !p.ends_with(&name) => format!("{p}.{name}"),
        (p, _) => p.to_string(),
    };
    let (field, message) = if let Some(rest) = msg.strip_prefix("missing field ") {
        (field_in(quoted(rest)), "is required".to_string())
    } else if let Some(rest) = msg.strip_prefix("unknown field ") {
        let expected = rest
            .split_once(", expected ")
            .map_or_else(String::new, |(_, e)| format!("; expected {e}"));
        (
            field_in(quoted(rest)),
            format!("is not a known field{expected}"),
        )
    } else if let Some(rest) = msg.strip_prefix("duplicate field ") {
        (field_in(quoted(rest)), "is given twice".to_string())
    } else if let Some(rest) = msg.strip_prefix("unknown variant ") {
        let (got, expected) = rest
            .split_once(", expected ")
            .unwrap_or((rest, "another value"));
        (field_in(None), format!("must be {expected} (got {got})"))
    } else if let Some((got, expected)) = ["invalid type: ", "invalid value: ", "invalid length "]
        .iter()
        .find_map(|p| msg.strip_prefix(p))
        .and_then(|rest| rest.rsplit_once(", expected "))
    {
        let got = match got {
            "sequence" => "an array",
            "map" => "an object",
            "unit" => "null",
            other => other,
        };
        (
            field_in(None),
            format!("must be {} (got {got})", json_type(expected)),
        )
    } else {
        (field_in(None), sanitize(msg))
    };
    FieldProblem { field, message }
}

/// What serde expected, in JSON's terms.
pub(crate) fn json_type(expected: &str) -> String {
    match expected {
        "f64" | "f32" => "a number".into(),
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a whole number of at least 0".into(),
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "a whole number".into(),
        "a map" => "a JSON object".into(),
        "a sequence" => "a JSON array".into(),
        "a boolean" | "bool" => "true or false".into(),
        "a string" | "char" | "String" => "a string".into(),
        e if e.starts_with("struct ") || e.starts_with("map") => "a JSON object".into(),
        e if e.starts_with("enum ") => "one of the documented values".into(),
        e => sanitize(e),
    }
}

/// A message with any Rust type name (`struct X`, `enum X`) replaced by what it is in JSON.
fn sanitize(msg: &str) -> String {
    let mut out = Vec::new();
    let mut words = msg.split(' ').peekable();
    while let Some(w) = words.next() {
        match w {
            "struct" if words.peek().is_some() => {
                words.next();
                out.push("a JSON object");
            }
            "enum" if words.peek().is_some() => {
                words.next();
                out.push("one of the documented values");
            }
            w => out.push(w),
        }
    }
    out.join(" ")
}

/// Path parameters whose rejections become problem responses naming the parameter.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(Self(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                // A lone parameter's parse error does not name it: the route's one key does.
                let only = RawPathParams::from_request_parts(parts, state)
                    .await
                    .ok()
                    .and_then(|p| {
                        let keys: Vec<String> = p.iter().map(|(k, _)| k.to_string()).collect();
                        (keys.len() == 1).then(|| keys[0].clone())
                    });
                Err(path_problem(e.kind(), only.as_deref().unwrap_or("path")))
            }
            Err(_) => Err(bad_request("path", "could not be read")),
        }
    }
}

fn path_problem(kind: &ErrorKind, only: &str) -> ApiError {
    match kind {
        ErrorKind::InvalidUtf8InPathParam { key } => {
            bad_request(key.as_str(), "must be valid UTF-8 once percent-decoded")
        }
        ErrorKind::ParseErrorAtKey {
            key,
            value,
            expected_type,
        } => bad_request(
            key.as_str(),
            format!("must be {} (got {value:?})", json_type(expected_type)),
        ),
        ErrorKind::ParseError {
            value,
            expected_type,
        } => bad_request(
            only,
            format!("must be {} (got {value:?})", json_type(expected_type)),
        ),
        ErrorKind::DeserializeError { key, message, .. } => {
            bad_request(key.as_str(), sanitize(message))
        }
        _ => bad_request("path", "is not valid"),
    }
}

/// `application/json` or `application/*+json`, parameters allowed, case-insensitive: what
/// axum's `Json` accepts, without parsing a full media type on every request.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    // What every well-behaved client sends: one comparison instead of a parse.
    if ct.as_bytes() == b"application/json" {
        return true;
    }
    let Ok(ct) = ct.to_str() else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or_default().trim();
    let Some((ty, sub)) = essence.split_once('/') else {
        return false;
    };
    let json_suffix = sub.len() > 5
        && sub.is_char_boundary(sub.len() - 5)
        && sub[sub.len() - 5..].eq_ignore_ascii_case("+json");
    ty.eq_ignore_ascii_case("application") && (sub.eq_ignore_ascii_case("json") || json_suffix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(ct: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        h
    }

    #[test]
    fn json_media_types_are_recognised_as_axum_does() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            " application/json ;charset=UTF-8",
            "application/merge-patch+json",
            "application/problem+JSON",
        ] {
            assert!(json_content_type(&with(ok)), "{ok}");
        }
        for bad in [
            "text/json",
            "application/jsonx",
            "application/+json",
            "application",
            "json",
            "text/plain; x=application/json",
            "",
        ] {
            assert!(!json_content_type(&with(bad)), "{bad:?}");
        }
        assert!(!json_content_type(&HeaderMap::new()), "no content type");
    }
}
