"""Failures of storage libraries in words: what went wrong, and what to do about it."""

from __future__ import annotations

__all__ = ["describe_storage_error", "no_such_bucket"]

# Cause names of storage-library exceptions, matched by class name: the libraries are optional
# (botocore comes with s3fs, google-auth with gcsfs, ...) and share no base class.
_NO_CREDENTIALS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",
    }
)
_UNREACHABLE = frozenset(
    {
        "ConnectionError",
        "EndpointConnectionError",
        "ClientConnectorError",
        "ServerDisconnectedError",
    }
)
# Error codes of an S3-style service answer (``err.response["Error"]["Code"]``).
_REFUSED_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_DENIED = frozenset({"AccessDenied", "AllAccessDisabled", "Forbidden", "403"})
_MAX_DETAIL = 300


def _error_code(err: BaseException) -> str | None:
    """The service's error code of ``err`` or of the exception it was translated from."""
    for candidate in (err, err.__cause__, err.__context__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
    return None


def no_such_bucket(err: BaseException) -> bool:
    """Whether ``err`` says the bucket of the URL does not exist."""
    # s3fs turns NoSuchBucket into FileNotFoundError, sometimes without the cause attached.
    return _error_code(err) == "NoSuchBucket" or "bucket does not exist" in str(err)


def describe_storage_error(err: BaseException) -> str:
    """The cause of a storage library's ``err`` in words, its own message after it (one line).

    Example: ``no credentials found (NoCredentialsError: Unable to locate credentials); give
    them in storage_options, or where the storage library looks for them``.
    """
    names = {cls.__name__ for cls in type(err).__mro__}
    code = _error_code(err)
    hint = ""
    if names & _NO_CREDENTIALS:
        cause = "no credentials found"
        hint = "give them in storage_options, or where the storage library looks for them"
    elif no_such_bucket(err):
        cause = "no such bucket"
        hint = "create it first (a save never creates buckets)"
    elif code in _REFUSED_CREDENTIALS:
        cause = "permission denied: the credentials were refused"
    elif isinstance(err, PermissionError) or code in _DENIED:
        cause = "permission denied"
    elif names & _UNREACHABLE:
        cause = "cannot reach the endpoint"
        hint = "check the URL, endpoint_url in storage_options, and the network"
    elif isinstance(err, TimeoutError) or any("Timeout" in name for name in names):
        cause = "the request timed out"
    else:
        cause = "the storage failed"
    detail = " ".join(str(err).split())
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    text = f"{cause} ({type(err).__name__}{': ' + detail if detail else ''})"
    return f"{text}; {hint}" if hint else text
