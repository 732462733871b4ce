"""Local services the embedded default needs: a real S3 server and a real Prefect server."""
