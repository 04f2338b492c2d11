//! rext4 engine (placeholder)
