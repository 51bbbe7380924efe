//! Root package: owns the workspace-wide tests in `tests/`. See `tests/README.md`.
