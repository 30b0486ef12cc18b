//! engine (in progress)
