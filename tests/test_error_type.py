"""One ErrorType for the envelope and the stream's error event (``streams/error_type.py``).

The app re-exports the streams' enum and gives every member an HTTP status; the streams
end a stream with members of it, never with a bare string.
"""

from __future__ import annotations

import app.errors
import streams
from streams import ErrorType, StreamError


def test_the_app_and_the_streams_share_one_enum_with_a_status_for_every_member() -> None:
    assert app.errors.ErrorType is streams.ErrorType
    assert set(app.errors.STATUS) == set(ErrorType)


def test_a_stream_error_carries_the_enum() -> None:
    error = StreamError(ErrorType.SLOW_CLIENT, "too slow")

    assert error.type is ErrorType.SLOW_CLIENT
    assert error.type.value == "slow_client"
