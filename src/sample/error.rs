//! The sampler's errors.

/// Errors from configuring or running the sampler.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("invalid sampler parameter {name} = {value}: {reason}")]
    InvalidParameter {
        name: &'static str,
        value: String,
        reason: &'static str,
    },
    /// The logits row is empty, or every token in it is masked (`-inf`).
    #[error("no candidate token: logits are empty or every token is masked (-inf)")]
    EmptyLogits,
    /// The logits row contains NaN or `+inf`.
    #[error("logits contain NaN or +inf")]
    NonFiniteLogits,
    /// The constraint failed (its message), or refused a token accepted
    /// into the sampler.
    #[error("constraint: {0}")]
    Constraint(String),
}
