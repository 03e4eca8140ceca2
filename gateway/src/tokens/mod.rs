//! Gateway signing keys and tokens (being written).
