//! One problem with a configuration, naming the field, and all of them at once.

use std::fmt;

/// One problem with a configuration, naming where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Every problem found while loading a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors(pub Vec<ConfigProblem>);

pub(crate) fn problem(field: impl Into<String>, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        field: field.into(),
        message: message.into(),
    }
}
