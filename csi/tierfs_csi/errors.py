"""The one error the plugin's logic raises: a gRPC status code and a message for the CO."""

from __future__ import annotations

import grpc


class CsiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)
