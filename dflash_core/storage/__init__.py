"""The object store and what a write to storage needs around it: the S3 client (`store`), what each of its
failures means (`errors`), a full local disk (`disk`) and where a bucket key lands on this machine
(`local_paths`).

The names below load on first use, so that importing `disk` or `local_paths` (standard library only: the
node image reads them) does not import boto3."""

from dflash_core.lazy_names import lazy_getattr

_HOMES = {
    "MULTIPART_THRESHOLD": "store", "PROGRESS_THRESHOLD": "store", "SHA256_METADATA_KEY": "store",
    "ObjectInfo": "store", "ObjectStore": "store", "WriteGuard": "store", "longest_request_s": "store",
    "sha256_bytes": "store", "sha256_file": "store",
    "ChecksumMismatch": "errors", "ObjectNotFound": "errors", "PreconditionFailed": "errors",
    "StoreConfigError": "errors", "StoreError": "errors", "StoreUnavailable": "errors",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
