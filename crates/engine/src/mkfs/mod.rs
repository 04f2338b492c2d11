//! mkfs (placeholder, being written)
