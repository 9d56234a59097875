"""What a reader lets one record declare before it allocates the record's rows.

Route bytes come from Redis or over HTTP, and a few hundred compressed bytes can declare (and
validly hold) hundreds of megabytes of rows. Every reader checks a record's declared shape
against its :class:`ReadLimits` before it decompresses anything, and refuses a larger record
with :class:`RouteLimitError` for that id alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import RouteLimitError

__all__ = ["DEFAULT_LIMITS", "ReadLimits", "decoded_bytes"]


def decoded_bytes(T: int, M: int, K: int, E: int, weights: bool) -> int:
    """Bytes of a decoded record of ``T`` rows: int64 token ids, validity, ids (uint8 up to
    256 experts, else uint16) and, with ``weights``, float32 weights."""
    per_id = (1 if E <= 256 else 2) + (4 if weights else 0)
    return T * 9 + T * M * K * per_id


@dataclass(frozen=True)
class ReadLimits:
    """Per-record limits of a reader (decode, store reads, HTTP reads).

    ``max_rows``: tokens in one record; the default, 2,097,152, is twice the longest context
    of current MoE models. ``max_bytes``: the decoded record (:func:`decoded_bytes`); the
    default, 4 GiB, holds a 2M-token record of 48 layers x top-8 ids. Raise either for
    longer records; lower them where a reader must not trust its source with that much."""

    max_rows: int = 1 << 21
    max_bytes: int = 1 << 32

    def __post_init__(self) -> None:
        if self.max_rows < 0 or self.max_bytes < 0:
            raise ValueError(f"ReadLimits must be >= 0, got {self}")

    def check(self, T: int, M: int, K: int, E: int, weights: bool, what: str) -> None:
        """Refuse a record of this declared shape that exceeds a limit (RouteLimitError)."""
        if T > self.max_rows:
            raise RouteLimitError(
                f"{what}: {T} rows, more than this reader's max_rows={self.max_rows} "
                "(ReadLimits(max_rows=...) raises it)"
            )
        size = decoded_bytes(T, M, K, E, weights)
        if size > self.max_bytes:
            raise RouteLimitError(
                f"{what}: {size} bytes decoded, more than this reader's "
                f"max_bytes={self.max_bytes} (ReadLimits(max_bytes=...) raises it)"
            )


DEFAULT_LIMITS = ReadLimits()
