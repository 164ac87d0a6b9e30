"""The HTTP server: infer and manage requests, jobs, auth, persistence, metrics."""
