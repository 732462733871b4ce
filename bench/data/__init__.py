"""Data benches: `tokenize_throughput` (the tokenize stage's shard path against raw encoding), `s3_audit` (the
bucket audit and cleanup at 20,000 objects on a local S3 server)."""
