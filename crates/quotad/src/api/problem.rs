//! RFC 9457 problem responses: the one `ApiError` every handler returns, and the JSON extractor
//! that turns body rejections into problems naming what was wrong.
//!
//! Client errors explain themselves; internal errors are logged and answered without detail.

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
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
    #[error("invalid request body: {detail}")]
    BadBody { detail: String },
    #[error("invalid policy")]
    InvalidPolicy { errors: Vec<FieldProblem> },
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("{what} not found")]
    NotFound { what: &'static str },
    #[error("request body larger than the limit")]
    TooLarge,
    #[error("expected Content-Type: application/json")]
    UnsupportedMediaType,
    #[error("temporarily reduced capacity: {reason}")]
    ReducedCapacity { policy: String, reason: String },
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
            ApiError::BadField { .. } | ApiError::BadBody { .. } => {
                (StatusCode::BAD_REQUEST, "INVALID_REQUEST")
            }
            ApiError::InvalidPolicy { .. } => (StatusCode::BAD_REQUEST, "INVALID_POLICY"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
            ApiError::NotFound { .. } => (StatusCode::NOT_FOUND, "NOT_FOUND"),
            ApiError::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE"),
            ApiError::UnsupportedMediaType => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "UNSUPPORTED_MEDIA_TYPE")
            }
            ApiError::ReducedCapacity { .. } => (
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
            ApiError::ReducedCapacity { .. } => REDUCED_CAPACITY_TYPE.to_string(),
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
            ApiError::InvalidPolicy { errors } => errors.clone(),
            ApiError::BadField { field, message } => {
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
                ApiError::BadBody {
                    detail: r.body_text(),
                }
            }
        })?;
        // Most bodies are valid: parse them directly, and run the parse that tracks the path to
        // the bad field only to explain a failure.
        if let Ok(v) = serde_json::from_slice::<T>(&body) {
            return Ok(Self(v));
        }
        match axum::Json::<T>::from_bytes(&body) {
            Ok(axum::Json(v)) => Ok(Self(v)),
            Err(JsonRejection::JsonDataError(e)) => Err(ApiError::BadBody {
                detail: std::error::Error::source(&e)
                    .map_or_else(|| e.body_text(), ToString::to_string),
            }),
            Err(JsonRejection::JsonSyntaxError(e)) => Err(ApiError::BadBody {
                detail: std::error::Error::source(&e)
                    .map_or_else(|| e.body_text(), ToString::to_string),
            }),
            Err(e) => Err(ApiError::BadBody {
                detail: e.body_text(),
            }),
        }
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
