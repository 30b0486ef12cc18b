//! From image file bytes to a [`super::PreparedImage`].
