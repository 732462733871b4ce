"""What a failed S3 call means, and what the caller should do about it.

`dflash_core.storage.ObjectStore` turns every botocore error into one of these (and they are
importable from `dflash_core.storage` too):

- `StoreUnavailable`: unreachable, timed out, failed mid-request, 5xx or throttled. Retry later.
- `StoreConfigError`: wrong credentials, missing bucket, or an endpoint that answers but is not an
  S3 server. Retrying cannot help; the message names the setting to fix.
- `ObjectNotFound`: the key does not exist.
- `ChecksumMismatch`: the bytes read back do not hash to the sha256 recorded at upload.
- `PreconditionFailed`: a conditional write or delete found the object not as the caller named it
  (it exists, changed or is gone). Read it again and decide.
- `StoreError`: the base of all of them, and what any other S3 error becomes.
"""

from __future__ import annotations

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import (
    ClientError, ConnectionError as BotoConnectionError, ConnectTimeoutError, EndpointConnectionError,
    HTTPClientError,
)
from botocore.parsers import ResponseParserError


class StoreError(RuntimeError):
    """Base of every object-store error; the message says what to do."""


class StoreConfigError(StoreError):
    """The endpoint, bucket or credentials in Settings are wrong: retrying cannot help."""


class StoreUnavailable(StoreError):
    """A transient fault: the endpoint is unreachable, timed out, failed (5xx) or throttled us.
    Retry later; a setting is wrong only if this persists."""


class ObjectNotFound(StoreError, KeyError):
    def __init__(self, uri: str):
        super().__init__(uri)
        self.uri = uri

    def __str__(self) -> str:
        return f"{self.uri} does not exist"


class ChecksumMismatch(StoreError):
    """The bytes read back do not hash to the sha256 recorded when they were written."""


class PreconditionFailed(StoreError):
    """A conditional request's precondition did not hold: the object exists (`if_absent`), or is no
    longer at the ETag the caller named (`if_match`: changed or deleted since)."""


# What botocore and boto3 raise for a failed call; `translate` classifies each.
BOTO_ERRORS = (S3UploadFailedError, BotoConnectionError, HTTPClientError, ResponseParserError, ClientError)

_THROTTLING = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
               "RequestTimeout", "ServiceUnavailable", "InternalError", "503", "500", "502", "504"}
# 412 for a failed If-Match / If-None-Match; 409 when a concurrent conditional write won (AWS).
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


def not_s3(endpoint_url: str, detail: str) -> str:
    """The message for an endpoint that answers, but not as an S3 server would."""
    return (f"{endpoint_url} is not an S3 server: {detail}; set DFLASH_S3_ENDPOINT_URL to the S3 "
            "endpoint (the local one is started by `dflash services up`)")


def translate(error: Exception, *, bucket: str, endpoint_url: str, key: str | None,
              condition: str | None = None) -> StoreError:
    """The `StoreError` a botocore/boto3 error means, naming the key or the setting to fix. `key` is
    None for bucket-level calls (a 404 there is a missing bucket); `condition` describes the request's
    precondition (e.g. "If-Match: <etag>"), None for unconditional requests."""
    uri = f"s3://{bucket}/{key or ''}"
    if isinstance(error, S3UploadFailedError):  # boto3 wraps upload_file's error: classify the cause
        cause = error.__cause__ or error.__context__
        if isinstance(cause, (BotoConnectionError, HTTPClientError, ResponseParserError, ClientError)):
            return translate(cause, bucket=bucket, endpoint_url=endpoint_url, key=key, condition=condition)
        return StoreUnavailable(f"upload of {uri} failed: {error}")
    if isinstance(error, (EndpointConnectionError, ConnectTimeoutError)):
        return StoreUnavailable(
            f"cannot reach the S3 endpoint {endpoint_url} ({type(error).__name__}): if the server "
            "should be running it is down (retry later); if the URL is wrong set DFLASH_S3_ENDPOINT_URL, "
            "or start the local server with `dflash services up`")
    if isinstance(error, (BotoConnectionError, HTTPClientError)):  # read timeouts, cut connections
        return StoreUnavailable(f"S3 endpoint {endpoint_url} failed mid-request on {uri} "
                                f"({type(error).__name__}: {error}); retry later")
    if isinstance(error, ResponseParserError):
        return StoreConfigError(not_s3(endpoint_url, f"its answer is not S3's XML ({str(error)[:120]})"))
    assert isinstance(error, ClientError), error
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    headers = error.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    if code in _THROTTLING or status >= 500:
        return StoreUnavailable(f"S3 endpoint {endpoint_url} answered {code or status} on "
                                f"{uri} (a transient fault: retry later)")
    if condition is not None and (code in _PRECONDITION_CODES or status in (409, 412)):
        return PreconditionFailed(f"{uri}: precondition {condition} failed ({code or status}): the object "
                                  "exists, or changed or was deleted since it was read")
    # An S3 server puts an XML error code in the body of every failed GET/PUT/POST (and sends
    # x-amz-* headers); a bare HTTP status there means some other HTTP server answered.
    bodyless = error.operation_name in {"HeadObject", "HeadBucket"}
    amz_headers = any(name.startswith("x-amz-") for name in headers)
    if (not code or code.isdigit()) and not bodyless and not amz_headers:
        return StoreConfigError(not_s3(endpoint_url, f"it answered HTTP {status} without an S3 error code "
                                                     f"(server: {headers.get('server', 'unnamed')})"))
    if code == "NoSuchBucket" or (key is None and code in {"404", "NotFound"}):
        return StoreConfigError(
            f"bucket {bucket!r} does not exist at {endpoint_url}: set DFLASH_S3_BUCKET "
            "to an existing bucket, or create it (`dflash services up` creates the local one)")
    if code in _NOT_FOUND_CODES:
        if condition is not None:  # If-Match on a deleted object: not the version the caller named
            return PreconditionFailed(f"{uri}: precondition {condition} failed: the object is gone")
        return ObjectNotFound(uri)
    if code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"} or status == 403:
        return StoreConfigError(
            f"the S3 server at {endpoint_url} refused our credentials ({code}): check "
            "DFLASH_S3_ACCESS_KEY_ID and DFLASH_S3_SECRET_ACCESS_KEY")
    return StoreError(f"S3 {code or status} on {uri}: {error}")
