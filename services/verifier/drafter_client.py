"""The transport to one drafter: a bidirectional Speculate stream, opened on demand and
reopened after a failure, with a reader thread that queues the drafter's answers."""

from __future__ import annotations

import queue
import threading
import time

import grpc

from ..common import tls
from ..v1 import drafter_pb2, drafter_pb2_grpc


class DraftUnavailable(Exception):
    """No usable answer from the drafter for this step."""


class DrafterClient:
    """A Speculate stream to one drafter, opened on demand and reopened after a failure.

    `epoch` changes whenever a new stream opens: the drafter behind it knows nothing yet."""

    def __init__(self, address: str):
        self.address = address
        self.epoch = 0
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue | None = None
        self._responses: queue.Queue = queue.Queue()

    @property
    def is_open(self) -> bool:
        return self._requests is not None

    def send(self, request: drafter_pb2.SpeculateRequest) -> None:
        if self._requests is None:
            raise DraftUnavailable("stream not open")
        self._requests.put(request)

    def receive(self, step: int, deadline: float):
        """The drafter's answer to `step`, waiting until the monotonic `deadline`."""
        if self._requests is None:
            raise DraftUnavailable("stream not open")
        while True:
            try:
                item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DraftUnavailable("no drafts in time") from None
            if isinstance(item, Exception):
                self.close()
                raise DraftUnavailable(f"drafter stream failed: {item}") from None
            if item.step == step:
                return item
            # an answer to an earlier step that missed its deadline: drop it

    def open(self) -> None:
        self.close()
        self.epoch += 1
        self._channel = tls.channel(self.address, peer="drafter")
        requests: queue.Queue = queue.Queue()
        self._requests, self._responses = requests, queue.Queue()
        call = drafter_pb2_grpc.DrafterServiceStub(self._channel).Speculate(
            iter(requests.get, None)
        )
        threading.Thread(
            target=self._read, args=(call, self._responses), name="drafter-reader", daemon=True
        ).start()

    @staticmethod
    def _read(call, responses: queue.Queue) -> None:
        try:
            for response in call:
                responses.put(response)
            responses.put(ConnectionError("drafter closed the stream"))
        except grpc.RpcError as e:
            responses.put(ConnectionError(f"{e.code().name}: {e.details()}"))

    def close(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
