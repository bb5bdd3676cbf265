"""Per-stream backpressure at hypercorn's HTTP/2 edge: ``FlowBuffer``.

HTTP/2's flow control is per stream: hypercorn sends a stream's DATA as its window
allows and holds the rest in the stream's ``StreamBuffer``, whose ``push`` (the app's
write) is to wait above ``BUFFER_HIGH_WATER`` (32 KiB) until ``pop`` (the sending task)
drains it. But ``pop`` releases the writer whenever the chunk it took was under the
low-water mark, and with the window shut the chunk is empty: every attempt to send wakes
the writer, with nothing sent. So a reader that stops sending WINDOW_UPDATEs for one
stream never holds up its writer: hypercorn buffers the whole answer in memory, the hub
never sees a slow reader, and no policy applies (a probe: a stream whose window stayed
shut ran to its 400th token, all of it buffered). ``FlowBuffer`` releases the writer on
what has drained (the buffer under the low-water mark), which makes the app's write wait,
for that stream only, as a full socket makes it wait over HTTP/1.1.

No pgjones/hypercorn issue was found for it; the fork anycorn fixed the same ``pop``
(davidbrochart/anycorn#61). Drop ``FlowBuffer`` when hypercorn's ``pop`` does that, and
check ``tests/test_http2_backpressure.py`` still passes without it. ``h2_protocol.install``
makes hypercorn build one for each HTTP/2 stream.
"""

from __future__ import annotations

from hypercorn.protocol.h2 import (
    BUFFER_HIGH_WATER,
    BUFFER_LOW_WATER,
    BufferCompleteError,
    StreamBuffer,
)

from .write_blocks import write_blocked


class FlowBuffer(StreamBuffer):
    """hypercorn's stream buffer whose writer waits until what it wrote has drained
    (see the module docstring)."""

    async def push(self, data: bytes) -> None:
        """The app's write (hypercorn's override).

        Cancellation: nothing to undo: the data is buffered before the only wait (for the
        buffer to drain), which the cancel gives up; hypercorn's sending task still sends
        what is buffered, or the stream's close drops it.
        """
        if self._complete:
            raise BufferCompleteError()
        self.buffer.extend(data)
        await self._is_empty.clear()
        if len(self.buffer) >= BUFFER_HIGH_WATER:
            write_blocked()  # the window is shut: the hub no longer waits for it
        while len(self.buffer) >= BUFFER_HIGH_WATER:  # ``close`` empties it
            await self._paused.clear()
            await self._paused.wait()

    async def pop(self, max_length: int) -> bytes:
        """The sending task's take of up to ``max_length`` bytes (hypercorn's override):
        the writer is released only once the buffer is under the low-water mark.

        Cancellation: nothing to undo, as none can land: its awaits (hypercorn's event
        wrapper's ``set`` and ``clear``) neither wait nor checkpoint, so the bytes taken
        are always returned.
        """
        data = bytes(self.buffer[:max_length])
        del self.buffer[:max_length]
        if len(self.buffer) < BUFFER_LOW_WATER:
            await self._paused.set()
        if not self.buffer:
            await self._is_empty.set()
        return data
